"""LAMB / AdamW against torch.optim.AdamW and a per-tensor reference of LAMB's Algorithm 2."""

from __future__ import annotations

import copy
import io
import threading

import pytest
import torch

from popbert.optimizers import (
    ROUNDING_SCHEME,
    AdamW,
    Lamb,
    classify_parameter,
    functional,
    param_groups_by_name,
)
from popbert.optimizers import fused as fused_kernels
from popbert.optimizers.steps import adamw_step_, lamb_step_
from popbert.optimizers.tiling import tile_plan

REL_TOL = 1e-6


def _mlp(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.GELU(), torch.nn.Linear(32, 5)).to(
        dtype
    )


def _max_rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Worst per-tensor error relative to the tensor's largest magnitude."""
    actual, expected = actual.detach(), expected.detach()
    scale = expected.double().abs().max().clamp_min(1e-30)
    return float((actual.double() - expected.double()).abs().max() / scale)


def _set_random_grads(params: list[torch.Tensor], step: int, seed: int = 1234) -> None:
    gen = torch.Generator().manual_seed(seed + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)


# ----------------------------------------------------------------------------- AdamW


@pytest.mark.parametrize("tile_numel", ["auto", 50])
def test_adamw_matches_torch_adamw_over_100_steps(tile_numel: int | str) -> None:
    ours, ref = _mlp(), _mlp()
    groups = param_groups_by_name(ours.named_parameters(), weight_decay=0.05)
    ref_groups = param_groups_by_name(ref.named_parameters(), weight_decay=0.05)
    for g in ref_groups:
        del g["names"], g["trust_ratio"]
    opt = AdamW(groups, lr=3e-3, betas=(0.85, 0.995), eps=1e-6)
    opt.tile_numel = tile_numel  # 50 splits the 12x32 weight across tiles
    torch_opt = torch.optim.AdamW(ref_groups, lr=3e-3, betas=(0.85, 0.995), eps=1e-6, foreach=True)
    data = torch.Generator().manual_seed(7)
    for _ in range(100):
        x = torch.randn(16, 12, generator=data)
        y = torch.randn(16, 5, generator=data)
        for model, optimizer in ((ours, opt), (ref, torch_opt)):
            optimizer.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert _max_rel_err(a, b) <= REL_TOL
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        assert _max_rel_err(opt.state[p]["exp_avg_sq"], torch_opt.state[q]["exp_avg_sq"]) <= REL_TOL


def test_adamw_max_grad_norm_matches_torch_clipping() -> None:
    ours, ref = _mlp(1), _mlp(1)
    opt = AdamW(ours.parameters(), lr=1e-2, weight_decay=0.01, max_grad_norm=0.5)
    torch_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, eps=1e-6)
    for step in range(20):
        _set_random_grads(list(ours.parameters()), step)
        _set_random_grads(list(ref.parameters()), step)
        opt.step()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        torch_opt.step()
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert _max_rel_err(a, b) <= REL_TOL


def test_grad_scale_is_divided_out_and_grads_are_untouched() -> None:
    plain, scaled = _mlp(2), _mlp(2)
    opt_a = Lamb(plain.parameters(), lr=1e-2)
    opt_b = Lamb(scaled.parameters(), lr=1e-2)
    for step in range(5):
        _set_random_grads(list(plain.parameters()), step)
        _set_random_grads(list(scaled.parameters()), step)
        for p in scaled.parameters():
            p.grad.mul_(1024.0)
        before = [p.grad.clone() for p in scaled.parameters()]
        opt_a.step()
        opt_b.step(grad_scale=1024.0)
        for p, g in zip(scaled.parameters(), before, strict=True):
            assert torch.equal(p.grad, g)
    for a, b in zip(plain.parameters(), scaled.parameters(), strict=True):
        assert torch.equal(a, b)  # power-of-two scaling is exact


def test_adamw_ignores_trust_ratio_in_groups() -> None:
    model = _mlp()
    groups = param_groups_by_name(model.named_parameters(), weight_decay=0.01)
    opt = AdamW(groups, lr=1e-3)
    assert all(g["trust_ratio"] is False for g in opt.param_groups)


def test_rejects_unsupported_dtype_and_bad_hyperparameters() -> None:
    with pytest.raises(TypeError):
        Lamb([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))], lr=1e-3)
    with pytest.raises(ValueError):
        Lamb([torch.nn.Parameter(torch.zeros(3))], lr=1e-3, betas=(1.0, 0.999))
    with pytest.raises(ValueError):
        AdamW([torch.nn.Parameter(torch.zeros(3))], lr=1e-3, max_grad_norm=0.0)


# ----------------------------------------------------------------------------- LAMB

# popbert-style names: W/Embedding decay + LAMB, Gamma no decay + LAMB, B/Beta/Bias plain Adam.
_LAMB_SHAPES = {
    "Embedding/Embedding_Dict": (40, 16),
    "Layer0/Attention/QKV/W": (16, 48),
    "Layer0/Attention/QKV/B": (48,),
    "Layer0/Attention/Norm/Gamma": (16,),
    "Layer0/Attention/Norm/Beta": (16,),
    "Layer0/FF/Zero/W": (16, 8),  # starts at zero: exercises the ||w|| = 0 guard
    "CLS/MLM/Bias": (40,),
}


def _lamb_params(dtype: torch.dtype = torch.float32) -> list[tuple[str, torch.nn.Parameter]]:
    gen = torch.Generator().manual_seed(3)
    named = []
    for name, shape in _LAMB_SHAPES.items():
        value = torch.zeros(shape) if "Zero" in name else torch.randn(shape, generator=gen) * 0.2
        if name.endswith("Gamma"):
            value = value + 1.0
        named.append((name, torch.nn.Parameter(value.to(dtype))))
    return named


def _reference_lamb(
    named: list[tuple[str, torch.Tensor]],
    grads_per_step: list[list[torch.Tensor]],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    max_trust_ratio: float | None,
) -> list[torch.Tensor]:
    """LAMB, Algorithm 2 of You et al. (2019), one tensor at a time, in float64."""
    weights = [p.detach().double().clone() for _, p in named]
    m = [torch.zeros_like(w) for w in weights]
    v = [torch.zeros_like(w) for w in weights]
    for t, grads in enumerate(grads_per_step, start=1):
        for i, (name, _) in enumerate(named):
            decay, trust = classify_parameter(name)
            g = grads[i].double()
            m[i] = beta1 * m[i] + (1 - beta1) * g
            v[i] = beta2 * v[i] + (1 - beta2) * g * g
            m_hat = m[i] / (1 - beta1**t) if bias_correction else m[i]
            v_hat = v[i] / (1 - beta2**t) if bias_correction else v[i]
            r = m_hat / (v_hat.sqrt() + eps)
            u = r + (weight_decay if decay else 0.0) * weights[i]
            ratio = 1.0
            if trust:
                w_norm, u_norm = weights[i].norm().item(), u.norm().item()
                if w_norm > 0 and u_norm > 0:
                    ratio = w_norm / u_norm
                if max_trust_ratio is not None:
                    ratio = min(ratio, max_trust_ratio)
            weights[i] = weights[i] - lr * ratio * u
    return weights


@pytest.mark.parametrize(
    ("bias_correction", "max_trust_ratio", "tile_numel"),
    [
        (True, None, None),
        (False, None, None),
        (True, 0.5, None),
        (True, None, 37),
        (False, 2.0, 37),
    ],
)
def test_lamb_matches_paper_reference(
    bias_correction: bool, max_trust_ratio: float | None, tile_numel: int | None
) -> None:
    named = _lamb_params()
    initial = [(n, p.detach().clone()) for n, p in named]
    hyper = {"lr": 2e-2, "eps": 1e-6, "weight_decay": 0.01, "max_trust_ratio": max_trust_ratio}
    opt = Lamb(
        param_groups_by_name(named, weight_decay=hyper["weight_decay"]),
        lr=hyper["lr"],
        betas=(0.9, 0.999),
        eps=hyper["eps"],
        bias_correction=bias_correction,
        max_trust_ratio=max_trust_ratio,
    )
    opt.tile_numel = tile_numel  # 37: tensors split over tiles and tiles shared
    params = [p for _, p in named]
    grads_per_step = []
    for step in range(8):
        _set_random_grads(params, step)
        grads_per_step.append([p.grad.clone() for p in params])
        opt.step()
    expected = _reference_lamb(
        initial,
        grads_per_step,
        beta1=0.9,
        beta2=0.999,
        bias_correction=bias_correction,
        **hyper,
    )
    for (name, p), ref in zip(named, expected, strict=True):
        assert _max_rel_err(p.detach(), ref) <= REL_TOL, name
    # The zero-initialised weight moved (ratio 1 guard), exclusions did not silently no-op.
    assert torch.count_nonzero(dict(named)["Layer0/FF/Zero/W"]) > 0


def test_lamb_trust_ratio_guards_and_clamps() -> None:
    w_sq = torch.tensor([4.0, 0.0, 9.0, 16.0])
    u_sq = torch.tensor([1.0, 1.0, 0.0, 0.01])
    ratios = functional.lamb_trust_ratios(w_sq, u_sq)
    assert ratios.tolist() == pytest.approx([2.0, 1.0, 1.0, 40.0])
    clamped = functional.lamb_trust_ratios(w_sq, u_sq, max_trust_ratio=10.0, max_weight_norm=2.0)
    assert clamped.tolist() == pytest.approx([2.0, 1.0, 1.0, 10.0])


def test_sharded_composition_equals_whole_tensor_step() -> None:
    """Two shards with partial norms reduced by addition give the unsharded LAMB step."""
    gen = torch.Generator().manual_seed(11)
    shapes = [(6, 5), (7,), (3, 4)]
    weights = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    hyper = {"beta1": 0.9, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.01}

    whole = [w.clone() for w in weights]
    m = [torch.zeros_like(w) for w in weights]
    v = [torch.zeros_like(w) for w in weights]
    lamb_step_(whole, grads, m, v, [1, 1, 1], lr=0.1, **hyper)

    flat_w = torch.cat([w.flatten() for w in weights])
    flat_g = torch.cat([g.flatten() for g in grads])
    flat_m, flat_v = torch.zeros_like(flat_w), torch.zeros_like(flat_w)
    sizes = [w.numel() for w in weights]
    owner = torch.repeat_interleave(torch.arange(len(sizes)), torch.tensor(sizes))
    cut = flat_w.numel() // 2 + 1  # splits the second tensor across the shards
    shards = []
    w_sq = torch.zeros(len(sizes))
    u_sq = torch.zeros(len(sizes))
    for lo, hi in ((0, cut), (cut, flat_w.numel())):
        ids = owner[lo:hi].unique().tolist()
        pieces = []
        for i in ids:
            idx = (owner == i).nonzero().flatten()
            a, b = max(int(idx[0]), lo), min(int(idx[-1]) + 1, hi)
            pieces.append((i, a, b))
        ws = [flat_w[a:b] for _, a, b in pieces]
        gs = [flat_g[a:b] for _, a, b in pieces]
        ms = [flat_m[a:b] for _, a, b in pieces]
        vs = [flat_v[a:b] for _, a, b in pieces]
        steps = [1] * len(pieces)
        functional.adam_moments_(ms, vs, gs, hyper["beta1"], hyper["beta2"])
        denoms = functional.adam_denominators(vs, steps, hyper["beta2"], hyper["eps"], True)
        us = functional.lamb_updates(
            ws,
            ms,
            denoms,
            steps,
            beta1=hyper["beta1"],
            beta2=hyper["beta2"],
            weight_decay=0.01,
            bias_correction=True,
        )
        index = torch.tensor([i for i, _, _ in pieces])
        w_sq.index_add_(0, index, functional.per_tensor_sq_norms(ws))  # the "all-reduce"
        u_sq.index_add_(0, index, functional.per_tensor_sq_norms(us))
        shards.append((index, ws, us))
    ratios = functional.lamb_trust_ratios(w_sq, u_sq)
    for index, ws, us in shards:
        functional.apply_updates_(ws, us, 0.1, ratios[index])
    expected = torch.cat([w.flatten() for w in whole])
    assert _max_rel_err(flat_w, expected) <= REL_TOL


@pytest.mark.parametrize("tile_numel", [None, 5])
def test_lamb_step_on_shards_with_reduced_norms_equals_unsharded(tile_numel: int | None) -> None:
    """Two replicas (threads) each own a slice of the flat parameters; norms are all-reduced."""
    gen = torch.Generator().manual_seed(12)
    shapes = [(6, 5), (7,), (3, 4), (9,)]
    weights = [torch.randn(s, generator=gen) for s in shapes]
    grads = [torch.randn(s, generator=gen) for s in shapes]
    hyper = {"lr": 0.05, "beta1": 0.9, "beta2": 0.99, "eps": 1e-6, "weight_decay": 0.01}

    whole = [w.clone() for w in weights]
    m, v = [torch.zeros_like(w) for w in weights], [torch.zeros_like(w) for w in weights]
    for step in (1, 2):
        lamb_step_(whole, grads, m, v, [step] * len(shapes), **hyper)

    sizes = [w.numel() for w in weights]
    flat = {
        "w": torch.cat([w.flatten() for w in weights]),
        "g": torch.cat([g.flatten() for g in grads]),
        "m": torch.zeros(sum(sizes)),
        "v": torch.zeros(sum(sizes)),
    }
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    cut = offsets[1] + 3  # the second tensor is split between the replicas
    shard_ranges = [(0, cut), (cut, offsets[-1])]
    parts: list[torch.Tensor | None] = [None, None]
    barrier = threading.Barrier(2)

    def all_reduce(rank: int, sq: torch.Tensor) -> torch.Tensor:
        parts[rank] = sq.clone()
        barrier.wait()
        total = parts[0] + parts[1]
        barrier.wait()
        return total

    def replica(rank: int) -> None:
        lo, hi = shard_ranges[rank]
        ids, frags = [], {k: [] for k in flat}
        for i in range(len(sizes)):
            a, b = max(lo, offsets[i]), min(hi, offsets[i + 1])
            if a < b:
                ids.append(i)
                for k in flat:
                    frags[k].append(flat[k][a:b])
        for step in (1, 2):
            lamb_step_(
                frags["w"],
                frags["g"],
                frags["m"],
                frags["v"],
                [step] * len(ids),
                tensor_index=ids,
                num_tensors=len(sizes),
                reduce_sq_norms=lambda sq: all_reduce(rank, sq),
                tile_numel=tile_numel,
                **hyper,
            )

    threads = [threading.Thread(target=replica, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    expected = torch.cat([w.flatten() for w in whole])
    assert _max_rel_err(flat["w"], expected) <= REL_TOL
    assert _max_rel_err(flat["v"], torch.cat([t.flatten() for t in v])) <= REL_TOL


def test_tile_plan_covers_every_element_once() -> None:
    sizes = [5, 0, 100, 3, 64, 7, 16]
    splittable = [True, True, True, True, False, True, True]
    plan = tile_plan(sizes, 16, splittable)
    pieces: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(sizes))}
    order = []
    for tile in plan:
        assert tile
        if all(i != 4 for i, _, _ in tile):
            assert sum(stop - start for _, start, stop in tile) <= 16
        for i, start, stop in tile:
            assert stop > start
            pieces[i].append((start, stop))
            order.append(i)
    assert order == sorted(order)  # tensors stay in order
    for i, n in enumerate(sizes):
        edges = [0] + [b for _, b in pieces[i]]
        assert [a for a, _ in pieces[i]] == edges[:-1] and edges[-1] == n
    assert pieces[4] == [(0, 64)]  # not splittable: one piece
    assert tile_plan(sizes, None) == [[(i, 0, n) for i, n in enumerate(sizes)]]


def test_tiled_half_precision_step_matches_untiled_round_to_nearest() -> None:
    """Tiling only changes where work happens: with RTN the half weights agree exactly."""
    results = []
    for tile_numel in (None, 29):
        named = [(n, torch.nn.Parameter(p.detach().bfloat16())) for n, p in _lamb_params()]
        opt = Lamb(param_groups_by_name(named, 0.01), lr=1e-2, stochastic_rounding=False)
        opt.tile_numel = tile_numel
        _run(opt, [p for _, p in named], range(4))
        results.append([p.detach().clone() for _, p in named])
    for a, b in zip(*results, strict=True):
        ulp = 2.0**-7 * max(1.0, float(b.float().abs().max()))
        assert float((a.float() - b.float()).abs().max()) <= ulp  # ratio sums may differ by 1 ulp


# ----------------------------------------------------------------------------- exclusions


@pytest.mark.parametrize(
    ("name", "decay", "trust"),
    [
        ("Layer0/Attention/QKV/W", True, True),
        ("Layer0/Attention/QKV/B", False, False),
        ("Layer0/Attention/Norm/Gamma", False, True),
        ("Layer0/Attention/Norm/Beta", False, False),
        ("Embedding/Embedding_Dict", True, True),
        ("CLS/MLM/Bias", False, False),
        ("bert.encoder.layer.0.attention.self.query.weight", True, True),
        ("bert.encoder.layer.0.attention.self.query.bias", False, False),
        ("bert.encoder.layer.0.output.LayerNorm.weight", False, True),
        ("bert.embeddings.LayerNorm.bias", False, False),
        ("blocks.3.norm1.weight", False, True),
        ("transformer.ln_f.weight", False, True),
        ("cls.predictions.bias", False, False),
        ("bert.embeddings.word_embeddings.weight", True, True),
        ("Layer0/Attention/Blend/W", True, True),
    ],
)
def test_default_exclusions(name: str, decay: bool, trust: bool) -> None:
    assert classify_parameter(name) == (decay, trust)


def test_param_groups_by_name_builds_groups_with_options() -> None:
    named = _lamb_params()
    named.append(("Frozen/W", torch.nn.Parameter(torch.zeros(2), requires_grad=False)))
    groups = param_groups_by_name(named, weight_decay=0.1, lr=5e-4)
    by_key = {(g["weight_decay"], g["trust_ratio"]): g["names"] for g in groups}
    assert by_key[(0.1, True)] == [
        "Embedding/Embedding_Dict",
        "Layer0/Attention/QKV/W",
        "Layer0/FF/Zero/W",
    ]
    assert by_key[(0.0, True)] == ["Layer0/Attention/Norm/Gamma"]
    assert by_key[(0.0, False)] == [
        "Layer0/Attention/QKV/B",
        "Layer0/Attention/Norm/Beta",
        "CLS/MLM/Bias",
    ]
    assert all(g["lr"] == 5e-4 for g in groups)
    no_exclusions = param_groups_by_name(named, 0.1, no_decay=None, no_trust=None)
    assert len(no_exclusions) == 1 and len(no_exclusions[0]["params"]) == len(_LAMB_SHAPES)


# ----------------------------------------------------------------------------- half weights


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_weights_keep_fp32_moments_and_track_fp32_run(dtype: torch.dtype) -> None:
    named32 = _lamb_params()
    named16 = [(n, torch.nn.Parameter(p.detach().to(dtype))) for n, p in named32]
    # Start both runs from identical (half-representable) weights.
    for (_, p32), (_, p16) in zip(named32, named16, strict=True):
        p32.data.copy_(p16.detach().float())
    opt32 = Lamb(param_groups_by_name(named32, 0.01), lr=1e-2)
    opt16 = Lamb(param_groups_by_name(named16, 0.01), lr=1e-2, seed=5)
    params32, params16 = [p for _, p in named32], [p for _, p in named16]
    for step in range(5):
        _set_random_grads(params32, step)
        _set_random_grads(params16, step)
        opt32.step()
        opt16.step()
    ulp = 2.0**-10 if dtype == torch.float16 else 2.0**-7
    for p32, p16 in zip(params32, params16, strict=True):
        assert p16.dtype == dtype
        state = opt16.state[p16]
        assert {state["exp_avg"].dtype, state["exp_avg_sq"].dtype} == {torch.float32}
        # 5 stochastically rounded steps: within a few ulps of the FP32 trajectory.
        tol = 6 * ulp * max(1.0, float(p32.detach().abs().max()))
        assert float((p16.detach().float() - p32.detach()).abs().max()) <= tol


def test_fp16_weight_moves_with_stochastic_rounding_only() -> None:
    """lr 1e-4 steps on an FP16 weight of 1.0 are below half an ulp (4.9e-4)."""
    n, steps, lr = 4096, 200, 1e-4
    sr = torch.nn.Parameter(torch.ones(n, dtype=torch.float16))
    rtn = torch.nn.Parameter(torch.ones(n, dtype=torch.float16))
    opt_sr = AdamW([sr], lr=lr, weight_decay=0.0, eps=1e-12, seed=0)
    opt_rtn = AdamW([rtn], lr=lr, weight_decay=0.0, eps=1e-12, stochastic_rounding=False)
    for _ in range(steps):
        for p in (sr, rtn):
            p.grad = torch.full_like(p, -1.0)  # Adam step of exactly lr upwards
        opt_sr.step()
        opt_rtn.step()
    assert torch.all(rtn == 1.0)
    mean = float(sr.detach().float().mean())
    assert abs(mean - (1.0 + steps * lr)) < 1e-3  # std of the mean is about 1e-4


# ----------------------------------------------------------------------------- checkpoints


def _run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: range) -> None:
    for step in steps:
        _set_random_grads(params, step)
        opt.step()


@pytest.mark.parametrize("cls", [Lamb, AdamW])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tile_numel", [None, 100])
def test_state_dict_round_trip_is_bit_exact(
    cls: type, dtype: torch.dtype, tile_numel: int | None
) -> None:
    def build(seed: int) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
        named = [(n, torch.nn.Parameter(p.detach().to(dtype))) for n, p in _lamb_params()]
        opt = cls(param_groups_by_name(named, 0.01), lr=1e-2, max_grad_norm=5.0, seed=seed)
        opt.tile_numel = tile_numel
        return [p for _, p in named], opt

    params, opt = build(seed=42)
    _run(opt, params, range(3))
    buffer = io.BytesIO()
    torch.save({"weights": [p.detach() for p in params], "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)

    resumed_params, resumed = build(seed=999)  # a different seed: the checkpoint must win
    with torch.no_grad():
        for p, w in zip(resumed_params, saved["weights"], strict=True):
            p.copy_(w)
    resumed.load_state_dict(saved["opt"])
    for p in resumed_params:
        assert resumed.state[p]["exp_avg"].dtype == torch.float32

    for step in range(3, 7):  # interleaved: aliasing between the two would show up
        _run(opt, params, range(step, step + 1))
        _run(resumed, resumed_params, range(step, step + 1))
    for a, b in zip(params, resumed_params, strict=True):
        assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            sa, sb = opt.state[a][key], resumed.state[b][key]
            assert torch.equal(sa, sb) if isinstance(sa, torch.Tensor) else sa == sb
    if dtype == torch.float16:  # the rounding counter: the seed here, the steps in the state
        assert saved["opt"]["popbert_rng"]["seed"] == 42
        assert saved["opt"]["popbert_rng"]["scheme"] == ROUNDING_SCHEME


def test_state_dict_copies_are_independent() -> None:
    params = [torch.nn.Parameter(torch.randn(4))]
    opt = Lamb(params, lr=1e-2)
    _run(opt, params, range(2))
    state = copy.deepcopy(opt.state_dict())
    other = Lamb([torch.nn.Parameter(params[0].detach().clone())], lr=1e-2)
    other.load_state_dict(state)
    _run(other, other.param_groups[0]["params"], range(2, 3))
    assert torch.equal(state["state"][0]["exp_avg"], opt.state[params[0]]["exp_avg"])


# ----------------------------------------------------------------------------- fused half step

_FUSE_MIN = 256  # pieces of at least this many elements take the fused kernels here


def _count_fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Fuse pieces from ``_FUSE_MIN`` elements on and record every fused kernel launch."""
    calls: list[str] = []
    run = fused_kernels._run_fused

    def counting(name: str, *operands: object) -> object:
        calls.append(name)
        return run(name, *operands)

    monkeypatch.setattr(fused_kernels, "COMPILE_MIN_NUMEL", _FUSE_MIN)
    monkeypatch.setattr(fused_kernels, "_run_fused", counting)
    return calls


def _half_run(cls: type, dtype: torch.dtype, fused: bool, monkeypatch: pytest.MonkeyPatch
              ) -> tuple[list[torch.Tensor], list[torch.Tensor], list[str]]:
    """Three steps over weights the tiles cut into fused and unfused pieces, with decay and
    no-decay (LAMB: trust and plain) groups, a loss scale and clipping."""
    with monkeypatch.context() as patch:
        calls = _count_fused_calls(patch)
        patch.setattr(fused_kernels, "_fused_failed", not fused)
        gen = torch.Generator().manual_seed(5)
        shapes = {"dense.weight": (23, 41), "dense.bias": (300,), "ln.weight": (29,),
                  "proj.weight": (640,), "proj.bias": (7,)}
        named = [(name, torch.nn.Parameter((torch.randn(s, generator=gen) * 0.05).to(dtype)))
                 for name, s in shapes.items()]
        named[0][1].data.view(-1)[:40] = 0.0  # zeros: FP16's tiny results take the exact path
        opt = cls(param_groups_by_name(named, 0.01), lr=2e-2, seed=11, max_grad_norm=5.0)
        opt.tile_numel = 600  # dense.weight: pieces of 600 and 343, and small neighbours
        params = [p for _, p in named]
        for step in range(3):
            for p in params:
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).to(dtype)
            opt.step(grad_scale=4.0 if step == 1 else None)
        moments = [opt.state[p][k] for p in params for k in ("exp_avg", "exp_avg_sq")]
        return [p.detach().clone() for p in params], moments, calls


@pytest.mark.parametrize("cls", [AdamW, Lamb])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_half_step_is_bit_identical_to_the_unfused_one(
    cls: type, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Weights, their stochastic rounding and both moments: the same bits as the FP32-copy
    path (which torch.compile does not touch), for both optimizers and half formats."""
    fused_w, fused_m, calls = _half_run(cls, dtype, True, monkeypatch)
    plain_w, plain_m, plain_calls = _half_run(cls, dtype, False, monkeypatch)
    assert "moments" in calls and not plain_calls  # the comparison is not vacuous
    assert ("apply" in calls) == (cls is Lamb)
    for a, b in zip(fused_w, plain_w, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    for a, b in zip(fused_m, plain_m, strict=True):
        assert torch.equal(a, b)


def _moments_both_ways(lerp_end: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One moments update by the fused kernel and by the unfused step's eager ops
    (``m.lerp_(g, 1 - b1)``, ``v.mul_(b2).addcmul_(g, g, value=1 - b2)``), same inputs."""
    gen = torch.Generator().manual_seed(3)
    g, m = torch.randn(50_000, generator=gen) * 1e-2, torch.randn(50_000, generator=gen) * 1e-3
    v = torch.rand(50_000, generator=gen) * 1e-5
    beta1, beta2 = (0.3 if lerp_end else 0.9), 0.999
    hp, end = fused_kernels._moment_scalars(beta1, beta2, 2, 1e-6, True, 1.0)
    assert end == lerp_end
    fused_m, fused_v = m.clone(), v.clone()
    fused_kernels._run_fused("moments", g, fused_m, fused_v, torch.tensor(hp), lerp_end)
    eager_m, eager_v = m.clone().lerp_(g, 1 - beta1), v.clone().mul_(beta2)
    eager_v.addcmul_(g, g, value=1 - beta2)
    return [fused_m, fused_v], [eager_m, eager_v]


def test_fused_kernels_stay_compiled_past_dynamos_recompile_limit(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past its recompile limit Dynamo runs a function eagerly, where ``prims.fma`` rounds
    twice. With the global limit at 1 the second variant of the moments kernel (the other lerp
    branch) would run so, an ulp off the unfused step; the kernels' own limit keeps it compiled
    and equal. Negative control: without it the moments differ; a limit reached anyway raises
    instead of running eagerly."""
    for limits, outcome in (({"recompile_limit": 1}, "differs"),
                            ({"recompile_limit": 1, "fail_on_recompile_limit_hit": True},
                             "raises"),
                            (fused_kernels.DYNAMO_LIMITS, "equal")):
        torch._dynamo.reset()
        fused_kernels._fused_kernels.clear()
        monkeypatch.setattr(fused_kernels, "DYNAMO_LIMITS", limits)
        # (Dynamo's config is patched its own way: monkeypatch would delete the key after)
        with torch._dynamo.config.patch(recompile_limit=1):
            fused, eager = _moments_both_ways(lerp_end=False)  # the first variant: compiled
            assert all(torch.equal(a, b) for a, b in zip(fused, eager))
            if outcome == "raises":
                with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
                    _moments_both_ways(lerp_end=True)
                continue
            fused, eager = _moments_both_ways(lerp_end=True)
        same = all(torch.equal(a, b) for a, b in zip(fused, eager))
        assert same == (outcome == "equal"), outcome
    torch._dynamo.reset()  # later tests compile afresh
    fused_kernels._fused_kernels.clear()


def _fragments(tensors: list[torch.Tensor], cut: int) -> list[torch.Tensor]:
    """Tensor 0 split at element ``cut`` (as a shard boundary would), the others whole."""
    flat = tensors[0].view(-1)
    return [flat[:cut], flat[cut:], *tensors[1:]]


def test_fused_steps_on_fragments_round_with_element_offsets(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sharded use: fragments of a tensor know where they start (rounding offsets, LAMB's
    partial norms summed by ``reduce_sq_norms``). AdamW on fragments equals the whole-tensor
    step bit for bit; fused LAMB on fragments equals unfused LAMB on the same fragments."""
    from popbert.optimizers.stochastic_rounding import HashedRounding

    gen = torch.Generator().manual_seed(8)
    shapes = [(30, 37), (700,)]
    init = [(torch.randn(s, generator=gen) * 0.05).bfloat16() for s in shapes]
    grads = [(torch.randn(s, generator=gen) * 1e-2).bfloat16() for s in shapes]
    hyper = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-6, "weight_decay": 0.01}
    cut = 333  # fragments of 333 and 777 elements, both fused

    def run(kind: str, split: bool, fused: bool) -> list[torch.Tensor]:
        with monkeypatch.context() as patch:
            calls = _count_fused_calls(patch)
            patch.setattr(fused_kernels, "_fused_failed", not fused)
            w = [t.clone() for t in init]
            m, v = [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]
            lists = [w, grads, m, v]
            ids, offsets = [0, 1], [0, 0]
            if split:
                lists = [_fragments(t, cut) for t in lists]
                ids, offsets = [0, 0, 1], [0, cut, 0]
            for step in (1, 2):
                steps = [step] * len(ids)
                rounding = HashedRounding(3, steps, ids, offsets)
                if kind == "adamw":
                    adamw_step_(*lists, steps, **hyper, round_fn=rounding)
                else:
                    lamb_step_(*lists, steps, **hyper, round_fn=rounding,
                               tensor_index=ids, num_tensors=2,
                               reduce_sq_norms=lambda sq: sq.clone())
            assert bool(calls) == fused
            return [t.view(torch.int16) for t in w + m + v]

    for kind, reference in (("adamw", run("adamw", False, False)),
                            ("lamb", run("lamb", True, False))):
        for a, b in zip(run(kind, True, True), reference, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["adamw", "lamb"])
def test_fused_fp16_step_rounds_tiny_results_exactly(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Zero FP16 weights under gradients of 1e-20 move by ~1e-17, far below FP16's smallest
    subnormal: those lanes leave the fused loop for the exact path, with the unfused bits
    (here all round to zero: probability ~1e-10 each of becoming 2**-24)."""
    from popbert.optimizers.stochastic_rounding import HashedRounding

    gen = torch.Generator().manual_seed(4)
    n = 3 * _FUSE_MIN + 5
    grads = [torch.randn(n, generator=gen) * 1e-20]
    grads[0][::7] *= 1e15  # some lanes move by ordinary amounts
    hyper = {"lr": 1e-2, "beta1": 0.9, "beta2": 0.999, "eps": 1e-6, "weight_decay": 0.0}
    results, finished = [], []
    finish = fused_kernels.finish_hashed_fp16
    for fused in (True, False):
        with monkeypatch.context() as patch:
            calls = _count_fused_calls(patch)
            patch.setattr(fused_kernels, "_fused_failed", not fused)
            patch.setattr(fused_kernels, "finish_hashed_fp16",
                          lambda *a: (finished.append(a[0].numel()), finish(*a)))
            w, m, v = [torch.zeros(n, dtype=torch.float16)], [torch.zeros(n)], [torch.zeros(n)]
            for step in (1, 2):
                step_fn = adamw_step_ if kind == "adamw" else lamb_step_
                step_fn(w, grads, m, v, [step], **hyper, round_fn=HashedRounding(2, [step], [0]))
            assert bool(calls) == fused
            results.append(w[0].view(torch.int16))
    assert torch.equal(results[0], results[1])
    assert finished == [n, n]  # the fused run took the exact path at both steps


def test_fused_step_falls_back_when_its_probe_disagrees(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A fused kernel that rounds differently from torch's eager ops (here: a skewed step
    size) is caught by the first-use probe: the step runs unfused, with identical results."""
    reference, _, _ = _half_run(AdamW, torch.bfloat16, False, monkeypatch)
    kernel = fused_kernels._adamw_kernel

    def skewed(p, m, root, hp, *rest):  # noqa: ANN001, ANN002, ANN202
        kernel(p, m, root, hp * 1.001, *rest)

    monkeypatch.setattr(fused_kernels, "_KERNEL_FNS",
                        {**fused_kernels._KERNEL_FNS, "adamw": skewed})
    monkeypatch.setattr(fused_kernels, "_fused_kernels", {})
    monkeypatch.setattr(fused_kernels, "_fused_checked", {})
    with caplog.at_level("WARNING", logger="popbert.optimizers.fused"):
        weights, _, calls = _half_run(AdamW, torch.bfloat16, True, monkeypatch)
    assert "does not reproduce the unfused one" in caplog.text
    checked = fused_kernels._fused_checked  # one probe per kind (decay and no-decay group)
    assert checked and not any(checked.values())
    assert calls.count("adamw") == len(checked)  # each probe's fused run, then never again
    for a, b in zip(weights, reference, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_fused_step_honours_popbert_sr_compile_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """``POPBERT_SR_COMPILE=0`` (no torch.compile for rounding) also keeps the step unfused."""
    from popbert.optimizers import stochastic_rounding

    monkeypatch.setattr(stochastic_rounding, "_compile_disabled", True)
    _, _, calls = _half_run(Lamb, torch.bfloat16, True, monkeypatch)
    assert calls == []


def test_steps_without_large_pieces_compile_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small models keep the eager step: no probe, no compile (tens of seconds on CPU)."""
    launched: list[str] = []
    monkeypatch.setattr(fused_kernels, "_run_fused", lambda name, *a: launched.append(name))
    monkeypatch.setattr(fused_kernels, "_fused_checked", {})
    model = _mlp(dtype=torch.bfloat16)
    opt = Lamb(model.parameters(), lr=1e-3, seed=0)
    _run(opt, list(model.parameters()), range(2))
    assert launched == [] and fused_kernels._fused_checked == {}
