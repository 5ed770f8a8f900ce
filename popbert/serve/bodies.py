"""The bodies `popbert serve`'s routes take, as pydantic models: what a client may send, field
by field, under the names and defaults of the server it comes from (OpenAI, Text Embeddings
Inference, Cohere, vLLM, Infinity); and how a body pydantic refuses, or one with empty or
non-Unicode inputs, becomes one message naming the field."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictStr, Tag

from popbert.serve.routes import RequestError
from popbert.textfile import unicode_problem

Texts = StrictStr | list[StrictStr]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


# TEI's `truncation_direction`: an input too long loses its end ("Right", TEI's default) or its
# start ("Left"); of a pair, the longer text loses it. Tagging and SQuAD cut nothing (their
# windows cover the whole text), so there it has nothing to act on.
Truncation = Literal["Right", "right", "Left", "left"]


class EmbeddingsRequest(_Request):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields such as `user`
    input: StrictStr | list[StrictStr] | list[int] | list[list[int]]
    model: StrictStr
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    truncate: bool = True


class EmbedRequest(_Request):
    inputs: Texts
    normalize: bool = True
    truncate: bool = True
    prompt_name: StrictStr | None = None
    dimensions: int | None = Field(default=None, ge=1)
    truncation_direction: Truncation = "Right"


class EmbedAllRequest(_Request):
    """TEI's `/embed_all`: every token's state, not pooled."""

    inputs: Texts
    truncate: bool = True
    prompt_name: StrictStr | None = None
    truncation_direction: Truncation = "Right"


class SimilarityInputs(_Request):
    source_sentence: StrictStr
    sentences: list[StrictStr]


class SimilarityParameters(_Request):
    truncate: bool = True
    truncation_direction: Truncation = "Right"
    prompt_name: StrictStr | None = None


class SimilarityRequest(_Request):
    """TEI's `/similarity`, Hugging Face's sentence-similarity task."""

    inputs: SimilarityInputs
    parameters: SimilarityParameters = SimilarityParameters()


class QuestionContext(_Request):
    question: StrictStr
    context: StrictStr


# As TEI reads `inputs`: a list of exactly two texts is one pair, [text, text]; any other list
# is a batch (of texts, pairs or SQuAD questions). Tried in this order.
Pair = tuple[StrictStr, StrictStr]
PredictInput = Annotated[
    Pair | StrictStr | QuestionContext | list[Pair | StrictStr | QuestionContext],
    Field(union_mode="left_to_right")]


class PredictRequest(_Request):
    inputs: PredictInput
    raw_scores: bool = False
    truncate: bool = True
    truncation_direction: Truncation = "Right"


class RerankRequest(_Request):
    query: StrictStr
    texts: list[StrictStr]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool = True
    truncation_direction: Truncation = "Right"


class InfinityRerankRequest(_Request):
    """Infinity's `/rerank` (what its client sends): `documents` where TEI has `texts`;
    answered in Infinity's shape."""

    query: StrictStr
    documents: list[StrictStr]
    return_documents: bool = False
    raw_scores: bool = False
    model: StrictStr | None = None
    top_n: int | None = Field(default=None, ge=1)


# Infinity's client names this model when its user names none.
INFINITY_ANY_MODEL = "default/not-specified"


def _rerank_shape(body: Any) -> str:
    """Which `/rerank` a body is: Infinity's (documents, no texts), else TEI's."""
    if isinstance(body, dict) and "documents" in body and "texts" not in body:
        return "InfinityRerank"
    return "TEIRerank"


RerankBody = Annotated[Annotated[RerankRequest, Tag("TEIRerank")]
                       | Annotated[InfinityRerankRequest, Tag("InfinityRerank")],
                       Discriminator(_rerank_shape)]


class RerankDocument(_Request):
    text: StrictStr


class CohereRerankRequest(_Request):
    """Cohere's rerank request, v1 and v2 (Jina's and vLLM's `/v1/rerank` take the same):
    documents as texts or `{"text"}` objects, `top_n`, `return_documents`, and v2's
    `max_tokens_per_doc`. Cohere's other fields (v1's `rank_fields` and `max_chunks_per_doc`,
    v2's `relevant_spans` and `priority`) are refused by name, not ignored."""

    model: StrictStr | None = None
    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    top_n: int | None = Field(default=None, ge=0)  # vLLM's 0: all of them
    return_documents: bool | None = None
    max_tokens_per_doc: int | None = Field(default=None, ge=1)


class ScoreRequest(_Request):
    """vLLM's `/score`: one `text_1` against each `text_2`, or the two lists pair by pair; a
    cross-encoder's score of each pair (`use_activation: false`: its raw logit), an embedding
    model's cosine similarity."""

    model: StrictStr | None = None
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    use_activation: bool | None = None


class ClassifyRequest(_Request):
    """vLLM's `/classify`."""

    model: StrictStr | None = None
    input: StrictStr | list[StrictStr]


class TokenizeRequest(_Request):
    inputs: Texts
    add_special_tokens: bool = True
    prompt_name: StrictStr | None = None


class DecodeRequest(_Request):
    ids: list[int] | list[list[int]]
    skip_special_tokens: bool = True


# Names pydantic puts in an error's location for a union member of these kinds.
MODEL_NAMES = ("QuestionContext", "RerankDocument", "TEIRerank", "InfinityRerank")


def field_of(location: tuple[Any, ...]) -> str:
    """A pydantic error location as the field a client wrote: ("body", "input", 2) →
    input[2]; the union member names pydantic adds are left out."""
    parts = [part for part in location if part != "body"]
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part.startswith(("list[", "tuple[", "str", "int", "function-", *MODEL_NAMES)) \
                or "[" in part:
            continue
        else:
            text += ("." if text else "") + part
    return text or "body"


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str]:
    """(message, field) for a request pydantic refused: the first error, said plainly."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'bad JSON')})", \
            "body"
    field = field_of(tuple(first.get("loc", ())))
    if first.get("type") == "missing":
        return f"{field} is required", field
    if first.get("type") == "extra_forbidden":
        return f"{field}: no such field", field
    kinds = {error.get("type") for error in errors}
    if field in ("input", "inputs") and len(kinds) > 1:
        return (f"{field}: expected a text, a list of texts"
                + (", or lists of token ids" if field == "input" else "")), field
    return f"{field}: {first.get('msg', 'invalid')}", field


def check_inputs(field: str, values: Any) -> None:
    """A request with no inputs, an empty (or blank) text or pair member, or a text that is not
    Unicode (a lone surrogate, which JSON's escapes can write and no tokenizer reads) is a
    422."""
    if isinstance(values, str):
        values = [values]
    if not values:
        raise RequestError(422, f"{field}: expected at least one input, got none", field)
    for index, value in enumerate(values):
        texts = ([value] if isinstance(value, str) else list(value) if isinstance(value, tuple)
                 else [value.question, value.context] if isinstance(value, QuestionContext)
                 else [])
        for text in texts:
            problem = unicode_problem(text)
            if problem is not None:
                raise RequestError(422, f"{field}[{index}]: not Unicode text ({problem})", field)
        if isinstance(value, str) and not value.strip():
            raise RequestError(422, f"{field}[{index}] is an empty text", field)
        if isinstance(value, list) and not value:
            raise RequestError(422, f"{field}[{index}] is empty", field)
        if isinstance(value, tuple) and not all(text.strip() for text in value):
            raise RequestError(422, f"{field}[{index}] has an empty text in its pair", field)


__all__ = ["INFINITY_ANY_MODEL", "ClassifyRequest", "CohereRerankRequest", "DecodeRequest",
           "EmbedAllRequest", "EmbeddingsRequest", "EmbedRequest", "InfinityRerankRequest",
           "PredictRequest", "QuestionContext", "RerankBody", "RerankRequest", "ScoreRequest",
           "SimilarityRequest", "TokenizeRequest", "check_inputs", "field_of",
           "validation_message"]
