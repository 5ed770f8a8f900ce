"""Sentence embeddings against sentence-transformers with the same weights: a
sentence-transformers folder imported with `popbert import-hf`, exported with `--task
embedding` (pooling and normalisation as graph nodes) and run by `popbert predict embed` gives
`SentenceTransformer.encode`'s vectors; `popbert evaluate retrieval` ranks as exact cosine search
over those vectors does, scored as pytrec_eval scores.

Tolerance: 1e-5 on each vector component (the float32 encoder, pooling and normalisation of two
implementations; measured 1.5e-7 on the real all-MiniLM-L6-v2).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest
import pytrec_eval
import torch

from popbert.cli.main import main
from popbert.data.retrieval import read_beir
from popbert.errors import UsageError
from popbert.serve.embed import EmbedPredictor

BEIR = Path(__file__).parent.parent / "fixtures" / "retrieval"


def texts() -> list[str]:
    """Real text of mixed lengths: the fixture's Wikipedia leads, and two short ones."""
    corpus = [" ".join(json.loads(line)["text"].split())
              for line in (BEIR / "corpus.jsonl").read_text().splitlines()]
    return corpus[:10] + ["short", "Two words"]


def embed(model: Path, data: Path, output: Path, *extra: str) -> np.ndarray:
    assert main(["predict", "embed", "--model", str(model), "--data", str(data), "-o",
                 str(output), *extra]) == 0
    if output.suffix == ".npy":
        return np.load(output)
    return np.array([json.loads(line)["embedding"] for line in output.read_text().splitlines()])


@pytest.fixture(scope="module")
def minilm_embedding(minilm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("minilm-embedding")
    assert main(["import-hf", "--model", str(minilm_dir), "--output-dir",
                 str(root / "ckpt")]) == 0
    assert main(["export", "--checkpoint", str(root / "ckpt"), "--task", "embedding",
                 "--output", str(root / "embedding.onnx")]) == 0
    return root / "embedding.onnx"


@pytest.mark.e2e
def test_a_real_sentence_transformer_embeds_as_sentence_transformers(
        minilm_dir: Path, minilm_embedding: Path, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    data = tmp_path / "texts.txt"
    data.write_text("\n".join(texts()) + "\n")
    reference = SentenceTransformer(str(minilm_dir), device="cpu").encode(texts())
    for output in (tmp_path / "vectors.jsonl", tmp_path / "vectors.npy"):
        ours = embed(minilm_embedding, data, output)
        assert ours.shape == reference.shape == (12, 384)
        np.testing.assert_allclose(ours, reference, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)  # normalised


@pytest.mark.e2e
def test_retrieval_is_exact_cosine_search_scored_as_trec_eval(
        minilm_dir: Path, minilm_embedding: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    from sentence_transformers import SentenceTransformer

    capsys.readouterr()
    assert main(["evaluate", "retrieval", "--model", str(minilm_embedding), "--beir",
                 str(BEIR)]) == 0
    ours = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    beir = read_beir(BEIR)
    model = SentenceTransformer(str(minilm_dir), device="cpu")
    documents, queries = sorted(beir.corpus), sorted(beir.qrels)
    scores = model.similarity(model.encode([beir.queries[q] for q in queries]),
                              model.encode([beir.corpus[d] for d in documents])).numpy()
    run = {q: {d: float(scores[i, j]) for j, d in enumerate(documents)}
           for i, q in enumerate(queries)}
    result = pytrec_eval.RelevanceEvaluator(
        {q: dict(v) for q, v in beir.qrels.items()}, {"ndcg_cut_10", "recall_100"}).evaluate(run)
    assert ours["ndcg@10"] == pytest.approx(
        statistics.mean(r["ndcg_cut_10"] for r in result.values()), abs=1e-6)
    assert ours["recall@100"] == pytest.approx(
        statistics.mean(r["recall_100"] for r in result.values()), abs=1e-6)
    assert ours["queries"] == 30 and ours["documents"] == 60


def small_sentence_transformer(directory: Path, pooling: str, normalize: bool,
                               prompts: dict[str, str] | None = None) -> None:
    """A random one-layer BERT with the bundled vocabulary, as a sentence-transformers folder
    with `pooling` (and Normalize)."""
    import transformers
    from sentence_transformers import SentenceTransformer, models

    from popbert.data.tokenization import bundled_vocab_path

    torch.manual_seed(3)
    base = directory.parent / f"{directory.name}-bert"
    vocab = bundled_vocab_path()
    config = transformers.BertConfig(vocab_size=len(vocab.read_text().splitlines()),
                                     hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=64)
    transformers.BertModel(config).save_pretrained(str(base))
    transformers.BertTokenizerFast(str(vocab), do_lower_case=True).save_pretrained(str(base))
    transformer = models.Transformer(str(base), max_seq_length=48)
    modules = [transformer, models.Pooling(32, pooling_mode=pooling)]
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, prompts=prompts or {}, device="cpu").save(
        str(directory))


@pytest.mark.e2e
@pytest.mark.parametrize(("pooling", "normalize"), [("cls", False), ("max", True),
                                                    ("mean_sqrt_len_tokens", False)])
def test_every_pooling_and_prompts_as_sentence_transformers(pooling: str, normalize: bool,
                                                            tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    folder = tmp_path / "st"
    small_sentence_transformer(folder, pooling, normalize, {"query": "search_query: "})
    assert main(["import-hf", "--model", str(folder), "--output-dir", str(tmp_path / "ckpt")
                 ]) == 0
    model = tmp_path / "embedding.onnx"
    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--task", "embedding",
                 "--output", str(model)]) == 0
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(texts()) + "\n")
    reference = SentenceTransformer(str(folder), device="cpu")
    np.testing.assert_allclose(embed(model, data, tmp_path / "plain.npy"),
                               reference.encode(texts()), atol=1e-5, rtol=0)
    np.testing.assert_allclose(embed(model, data, tmp_path / "query.npy", "--prompt", "query"),
                               reference.encode(texts(), prompt_name="query"), atol=1e-5,
                               rtol=0)
    # `popbert serve --default-prompt-name query`: for requests that name no prompt
    from popbert.serve.routes import Served

    served = Served(model)
    served.use_default_prompt("query")
    np.testing.assert_allclose(served.embed(texts())[0],
                               reference.encode(texts(), prompt_name="query"), atol=1e-5, rtol=0)
    with pytest.raises(UsageError, match="--default-prompt-name passage: .* has the prompts .*"
                                         "query"):
        served.use_default_prompt("passage")


def test_a_pooling_popbert_has_no_node_for_is_one_line(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    folder = tmp_path / "st"
    small_sentence_transformer(folder, "weightedmean", False)
    capsys.readouterr()
    assert main(["import-hf", "--model", str(folder), "--output-dir",
                 str(tmp_path / "ckpt")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines()
              if line.startswith("popbert: error:")]
    assert len(errors) == 1 and "pooling_mode_weightedmean_tokens" in errors[0], errors
    assert not (tmp_path / "ckpt").exists()


def test_a_device_the_machine_lacks_is_one_line(minilm_embedding: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`predict`/`evaluate --device`: a GPU this machine lacks, or a name that is no device,
    is one line naming the flag, and nothing is written."""
    data = tmp_path / "texts.txt"
    data.write_text("a text\n")
    output = tmp_path / "out.npy"
    capsys.readouterr()
    assert main(["predict", "embed", "--model", str(minilm_embedding), "--data", str(data),
                 "-o", str(output), "--device", "cuda:7"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "--device cuda:7: not a device of this machine" in errors[0]
    assert main(["predict", "embed", "--model", str(minilm_embedding), "--data", str(data),
                 "-o", str(output), "--device", "gpu"]) == 2
    assert "--device: expected cpu, cuda or cuda:N, got 'gpu'" in capsys.readouterr().err
    assert not output.exists()


@pytest.mark.e2e
def test_export_hf_writes_a_sentence_transformers_folder_back(
        minilm_dir: Path, tmp_path: Path) -> None:
    """An embedding checkpoint goes back out as a folder `SentenceTransformer(path)` loads,
    with its pooling, normalisation, length and prompts, giving the same vectors."""
    from sentence_transformers import SentenceTransformer

    assert main(["import-hf", "--model", str(minilm_dir), "--output-dir",
                 str(tmp_path / "ckpt")]) == 0
    out = tmp_path / "st"
    assert main(["export-hf", "--checkpoint", str(tmp_path / "ckpt"), "--output-dir",
                 str(out)]) == 0
    back = SentenceTransformer(str(out), device="cpu")
    original = SentenceTransformer(str(minilm_dir), device="cpu")
    assert back.max_seq_length == original.max_seq_length == 256
    np.testing.assert_allclose(back.encode(texts()), original.encode(texts()), atol=1e-6,
                               rtol=0)
    assert main(["import-hf", "--model", str(out), "--output-dir", str(tmp_path / "again")]) == 0
    assert main(["export-hf", "--checkpoint", str(tmp_path / "again"), "--output-dir",
                 str(out)]) == 0  # its own earlier output is replaced


@pytest.mark.e2e
def test_the_openvino_embedding_export_gives_the_same_vectors(
        minilm_embedding: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = minilm_embedding.parent / "ckpt"
    ir = tmp_path / "ir"
    assert main(["export", "--checkpoint", str(checkpoint), "--task", "embedding", "--runtime",
                 "openvino", "--precision", "f32", "--output", str(ir)]) == 0
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(texts()) + "\n")
    np.testing.assert_allclose(embed(ir, data, tmp_path / "ir.npy"),
                               embed(minilm_embedding, data, tmp_path / "onnx.npy"),
                               atol=1e-5, rtol=0)
    # one inference per run, however many outputs it reads (it was one per output: twice the
    # work for SQuAD's two logits, or for vectors with token states)
    from popbert.serve import openvino_ir

    inferences = []
    real = openvino_ir.run
    monkeypatch.setattr(openvino_ir, "run",
                        lambda *args: (inferences.append(1), real(*args))[1])
    predictor = EmbedPredictor(ir)
    inferences.clear()  # compiling may run it
    states = predictor.token_states(texts()[:2], batch_size=2)
    assert len(inferences) == 1 and len(states) == 2
    predictor.forward({name: np.ones((1, 3), np.int64) for name in predictor.input_names},
                      predictor.output_names)
    assert len(inferences) == 2


@pytest.mark.e2e
def test_an_openvino_int8_embedding_export_calibrates_on_pairs(
        minilm_embedding: Path, tmp_path: Path) -> None:
    """`--runtime openvino --quantize int8 --calibration PAIRS` calibrates on every text of an
    embedding pairs file; its vectors keep the FP32 export's directions (cosine > 0.99: INT8)."""
    checkpoint = minilm_embedding.parent / "ckpt"
    ir = tmp_path / "int8"
    pairs = Path(__file__).parent.parent / "fixtures" / "embedding" / "triplets.jsonl"
    assert main(["export", "--checkpoint", str(checkpoint), "--task", "embedding", "--runtime",
                 "openvino", "--quantize", "int8", "--calibration", str(pairs), "--output",
                 str(ir)]) == 0
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(texts()) + "\n")
    ours = embed(ir, data, tmp_path / "int8.npy")
    exact = embed(minilm_embedding, data, tmp_path / "onnx.npy")
    cosine = np.sum(ours * exact, axis=1) / (np.linalg.norm(ours, axis=1)
                                             * np.linalg.norm(exact, axis=1))
    assert cosine.min() > 0.99, cosine.min()


def test_every_task_s_data_is_export_data(tmp_path: Path) -> None:
    """--eval and --calibration take any task's data (the export then checks it is its own
    task's): CoNLL tagged words and embedding pairs as well as rows and SQuAD."""
    from popbert.io import paths

    fixtures = Path(__file__).parent.parent / "fixtures"
    for data in (fixtures / "embedding" / "triplets.jsonl",
                 fixtures / "classification" / "sentiment.tsv",
                 fixtures / "squad" / "squad-v1.1-sample.json",
                 next((fixtures / "ner").glob("*.conll"))):
        paths.check_path("--calibration", data, paths.TASK_DATA)


def small_modernbert_sentence_transformer(directory: Path) -> None:
    """A random two-layer ModernBERT with a small WordPiece tokenizer.json, as a
    sentence-transformers folder (mean pooling, Normalize)."""
    import transformers
    from sentence_transformers import SentenceTransformer, models
    from tokenizers import Tokenizer, pre_tokenizers, processors
    from tokenizers import models as token_models

    torch.manual_seed(0)
    base = directory.parent / f"{directory.name}-modernbert"
    vocab = ["[PAD]", "[CLS]", "[SEP]", "[UNK]", "[MASK]"] + [chr(c) for c in range(97, 123)]
    vocab += ["the", "of", "and", "is", "in", "a", "to", "was", "##s", "##ed"]
    vocab += [f"w{i}" for i in range(256 - len(vocab))]
    config = transformers.ModernBertConfig(
        vocab_size=len(vocab), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=96, max_position_embeddings=128, global_attn_every_n_layers=1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2)
    transformers.ModernBertModel(config).save_pretrained(str(base))
    tokenizer = Tokenizer(token_models.WordPiece({w: i for i, w in enumerate(vocab)},
                                                 unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]").save_pretrained(str(base))
    SentenceTransformer(modules=[models.Transformer(str(base), max_seq_length=64),
                                 models.Pooling(64, pooling_mode="mean"), models.Normalize()],
                        device="cpu").save(str(directory))


@pytest.mark.e2e
def test_a_modernbert_sentence_transformer_embeds_as_sentence_transformers(
        tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    folder = tmp_path / "st"
    small_modernbert_sentence_transformer(folder)
    assert main(["import-hf", "--model", str(folder), "--output-dir", str(tmp_path / "ckpt")
                 ]) == 0
    model = tmp_path / "embedding.onnx"
    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--task", "embedding",
                 "--output", str(model)]) == 0
    lines = ["the cat is in a hat", "of and the", "a w12 w13 was to", "the dog barked",
             " ".join(["the"] * 80)]  # over the 64-token length: cut as sentence-transformers
    data = tmp_path / "texts.txt"
    data.write_text("\n".join(lines) + "\n")
    reference = SentenceTransformer(str(folder), device="cpu")
    np.testing.assert_allclose(embed(model, data, tmp_path / "vectors.npy"),
                               reference.encode(lines), atol=1e-5, rtol=0)
    # each token's state (`popbert serve`'s /embed_all), after ModernBERT's final norm
    states = EmbedPredictor(model).token_states(lines)
    expected = reference.encode(lines, output_value="token_embeddings")
    assert [len(rows) for rows in states] == [len(rows) for rows in expected]
    for ours, theirs in zip(states, expected):
        np.testing.assert_allclose(ours, theirs.numpy(), atol=2e-5, rtol=0)


def test_an_export_made_before_token_states_serves_all_but_embed_all(
        minilm_embedding: Path, tmp_path: Path) -> None:
    """Exports written before the token states were an output still serve every other route;
    asking one for the states is one line saying to export again."""
    import onnx

    from popbert.serve.routes import RequestError, Served

    old = onnx.load(str(minilm_embedding))
    kept = [output for output in old.graph.output if output.name != "token_embeddings"]
    del old.graph.output[:]
    old.graph.output.extend(kept)
    onnx.save(old, str(tmp_path / "old.onnx"))
    served = Served(tmp_path / "old.onnx")
    assert "/embed_all" not in served.routes() and "/embed" in served.routes()
    assert "/embed_all" in Served(minilm_embedding).routes()
    np.testing.assert_allclose(served.embed(["a text"])[0],
                               Served(minilm_embedding).embed(["a text"])[0], atol=1e-6)
    with pytest.raises(UsageError, match="has no token_embeddings output .*export the "
                                         "checkpoint again"):
        served.predictor.token_states(["a text"])
    # an answer holds a vector per token: bounded by the tokens one batch may hold
    with pytest.raises(RequestError, match=r"inputs: 10 tokens in all, more than the 9 "):
        Served(minilm_embedding).token_states(["a b c", "d e f"], max_tokens=9)
