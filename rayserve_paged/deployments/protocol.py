"""What every route of the OpenAI HTTP API shares: the request-body base, the generation
fields and their conversion to SamplingParams, error bodies, usage, model cards and the
validation helpers. Each route family's own request and response models live beside its
handler in serving/ (completions.py, chat.py, tokenization.py, lora.py).

Request bodies are tolerant where clients differ and strict where values matter, as vLLM's
server is: an unknown field is ignored (and logged by the server: `unknown_fields`), an
explicit `null` means "not set" for every optional field, and chat messages accept what
agent frameworks send (the `tool` role, `tool_calls`, `tool_call_id`, `name`, `content:
null`). Values are strict: a JSON value of the wrong type is a 400 (`"max_tokens": true`
or `"n": "2"` is not coerced). Text that reaches the
tokenizer must be valid Unicode (JSON can escape a lone UTF-16 surrogate). Sampling ranges (temperature >= 0, top_p in
(0, 1], ...) are checked once, by `SamplingParams`; `to_sampling_params` renames the
internal field in its message to the request's field, so every 400 names what the client
sent. Beyond OpenAI, the vLLM extensions (top_k, min_p, best_of, beam search,
repetition_penalty, stop_token_ids, ...) are accepted.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any, Literal


from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from rayserve_paged.core.sequence import MAX_PRIORITY, SamplingParams, SamplingParamsError

MAX_CHOICES = 16  # most n / best_of per prompt
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
MAX_PROMPTS = 128  # most prompts in one /v1/completions batch
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat top_logprobs
# |length_penalty| bound: beam scores divide by length ** length_penalty, which must stay a
# finite, non-zero float for any context length (2**20 ** 10 = 2**200)
MAX_LENGTH_PENALTY = 10.0

_REQUEST = ConfigDict(extra="allow", strict=True)
MAX_LOGIT_BIAS = 300  # most token ids in one logit_bias
MAX_CACHE_SALT_CHARS = 256
# a logit_bias key: ASCII digits only, as int() parses them ("²" and "--5" are not token
# ids; str.isdigit() accepts the first); 10 digits cover any vocabulary
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,10}", re.ASCII)


class RequestModel(BaseModel):
    """A request body part: unknown fields are kept aside (`model_extra`, logged, unused);
    a key whose value is null is dropped before validation, so null = the default."""

    model_config = _REQUEST

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data):
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data

    def unknown_fields(self, prefix: str = "") -> list[str]:
        """Names of the fields this server does not know, here and in nested parts."""
        names = [prefix + name for name in self.model_extra or {}]
        for name in type(self).model_fields:
            value = getattr(self, name)
            items = value if isinstance(value, list) else [value]
            for i, item in enumerate(items):
                if isinstance(item, RequestModel):
                    where = f"{prefix}{name}[{i}]." if isinstance(value, list) else f"{prefix}{name}."
                    names += item.unknown_fields(where)
        return names


def documented(**schema) -> dict:
    """JSON-schema keywords for the OpenAPI description only. The range itself is checked
    once, by SamplingParams, whose messages the 400s carry ("top_p: must be in (0, 1]")."""
    return {"json_schema_extra": schema}


# --------------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str = Field(description="What went wrong, naming the field when a field is at fault.")
    type: str = Field(description="invalid_request_error, not_found_error or server_error.")
    param: str | None = Field(None, description="The request field at fault, if any.")
    code: str | None = Field(None, description="Machine-readable code, e.g. model_not_found, invalid_api_key.")


class ErrorResponse(BaseModel):
    error: ErrorInfo


_PARAM_PREFIX = re.compile(r"^([A-Za-z_][A-Za-z0-9_.\[\]]*):")


def param_of(message: str) -> str | None:
    """The field an error message starts with ("top_p: must be in (0, 1]" -> "top_p")."""
    match = _PARAM_PREFIX.match(message)
    return match.group(1) if match else None


# --------------------------------------------------------------------------- requests


class StreamOptions(RequestModel):
    include_usage: bool = Field(False, description="Send a last chunk with usage counts (and no choices).")


class JsonSchemaFormat(RequestModel):
    name: str = Field("response", description="The schema's name (accepted, not used).")
    description: str | None = Field(None, description="What the schema is for (accepted, not used).")
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="The JSON schema the output must meet (omitted: any JSON object)."
    )
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced (constrained decoding).")


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text (free), json_object (any JSON object) or json_schema (the given schema)."
    )
    json_schema: JsonSchemaFormat | None = Field(None, description="With type json_schema: the schema.")

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: required when type is 'json_schema'")
        return self


class StructuredOutputsRequest(RequestModel):
    """vLLM's `structured_outputs` field: exactly one constraint."""

    json_: dict[str, Any] | str | None = Field(None, alias="json", description="A JSON schema (object or its text).")
    json_object: bool | None = Field(None, description="true: any JSON object.")
    regex: str | None = Field(None, description="A regular expression the whole output matches.")
    choice: list[str] | None = Field(None, description="The output is exactly one of these strings.")
    grammar: str | None = Field(None, description="A Lark or GBNF (llama.cpp) grammar.")
    disable_any_whitespace: bool = Field(
        False, description="JSON only: no whitespace at all (the default allows one space after ',' and ':')."
    )
    disable_additional_properties: bool = Field(
        False, description="JSON only: objects take only their declared properties (additionalProperties false)."
    )

    def constraint(self) -> dict[str, Any]:
        given = {"json": self.json_, "json_object": self.json_object or None, "regex": self.regex,
                 "choice": self.choice, "grammar": self.grammar}  # fmt: skip
        options = {"disable_any_whitespace": self.disable_any_whitespace,
                   "disable_additional_properties": self.disable_additional_properties}  # fmt: skip
        return {key: value for key, value in given.items() if value is not None} | {k: v for k, v in options.items() if v}


class GenerationRequest(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = Field(None, description="The served model name (GET /v1/models); omitted = the served model.")
    n: int = Field(1, ge=1, le=MAX_CHOICES, description="Choices returned per prompt.")
    temperature: float | None = Field(
        None,
        description="Sampling temperature >= 0; 0 is greedy. Default 1 (0 with use_beam_search).",
        **documented(minimum=0),
    )
    top_p: float | None = Field(
        None,
        description="Nucleus sampling: keep the smallest set of tokens with mass top_p, in (0, 1].",
        **documented(exclusiveMinimum=0, maximum=1),
    )
    top_k: int | None = Field(
        None, description="Keep the k most likely tokens; -1 or 0 disables.", **documented(minimum=-1)
    )
    min_p: float | None = Field(
        None,
        description="Drop tokens less likely than min_p times the most likely one, in [0, 1].",
        **documented(minimum=0, maximum=1),
    )
    presence_penalty: float | None = Field(
        None, description="Penalty in [-2, 2] for tokens already present.", **documented(minimum=-2, maximum=2)
    )
    frequency_penalty: float | None = Field(
        None,
        description="Penalty in [-2, 2] proportional to a token's count so far.",
        **documented(minimum=-2, maximum=2),
    )
    repetition_penalty: float | None = Field(
        None,
        description="Multiplicative penalty (> 0, 1 = off) on prompt and output tokens.",
        **documented(exclusiveMinimum=0),
    )
    seed: int | None = Field(
        None, ge=-(2**63), lt=2**64, description="Per-request seed: the same seed and request give the same output."
    )
    stop: str | list[str] | None = Field(
        None,
        description=f"Up to {MAX_STOP_STRINGS} non-empty strings that end generation (not included in the text).",
        json_schema_extra=lambda schema: schema.update(
            anyOf=[
                {"type": "string", "minLength": 1},
                {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP_STRINGS},
                {"type": "null"},
            ]
        ),
    )
    stop_token_ids: list[int] | None = Field(
        None,
        max_length=MAX_STOP_TOKEN_IDS,
        description="Token ids that end generation.",
        json_schema_extra=lambda schema: schema["anyOf"][0].update(items={"type": "integer", "minimum": 0}),
    )
    include_stop_str_in_output: bool = Field(False, description="Keep the matched stop string in the text.")
    ignore_eos: bool = Field(False, description="Keep generating after the end-of-sequence token.")
    skip_special_tokens: bool = Field(True, description="Leave special tokens out of the text.")
    use_beam_search: bool = Field(False, description="Beam search with width best_of (or n); needs temperature 0.")
    length_penalty: float = Field(
        1.0,
        ge=-MAX_LENGTH_PENALTY,
        le=MAX_LENGTH_PENALTY,
        description="Beam search: scores are logprob / length ** length_penalty.",
    )
    early_stopping: bool | Literal["never"] = Field(
        False, description="Beam search: stop when best_of hypotheses are done (true), heuristically (false), or never."
    )
    user: str | None = Field(
        None,
        description="End-user id. With routing: prefix, the session a fleet keeps on one replica when no "
        "x-session-id header is sent.",
    )
    logit_bias: dict[str, float] | None = Field(
        None,
        description=f"Token id (as a string) -> bias in [-100, 100] added to its logit; at most {MAX_LOGIT_BIAS}.",
    )
    min_tokens: int = Field(0, ge=0, description="Generate at least this many tokens before EOS or stop tokens.")
    cache_salt: str | None = Field(
        None,
        min_length=1,
        max_length=MAX_CACHE_SALT_CHARS,
        description="vLLM's: requests share prefix-cache blocks only with requests of the same salt (e.g. one "
        "per tenant), so cache hits, their timing and cached_tokens reveal nothing across salts.",
    )
    response_format: ResponseFormat | None = Field(
        None, description="text, json_object or json_schema: the output is constrained to valid JSON (docs/API.md)."
    )
    structured_outputs: StructuredOutputsRequest | None = Field(
        None, description="vLLM's constraint: one of json (a schema), json_object, regex, choice, grammar."
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="Older vLLM name of structured_outputs.json.")
    guided_regex: str | None = Field(None, description="Older vLLM name of structured_outputs.regex.")
    guided_choice: list[str] | None = Field(None, description="Older vLLM name of structured_outputs.choice.")
    guided_grammar: str | None = Field(None, description="Older vLLM name of structured_outputs.grammar.")
    priority: int | None = Field(
        None,
        ge=-MAX_PRIORITY,
        le=MAX_PRIORITY,
        description="Under scheduling_policy: priority, lower is more urgent: admitted first, preempted and shed "
        "last (vLLM's). Default 0, or the API key's limit when that is less urgent; a value more urgent than the "
        "key allows is a 403 (docs/API.md, 'Priority').",
    )
    stream: bool = Field(False, description="Answer with server-sent events, one chunk per step.")
    stream_options: StreamOptions | None = Field(None, description="Streaming options; only with stream: true.")
    # the request's Admission (deployments/admission.py), once its sequences are reserved
    _admission: Any = PrivateAttr(None)

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias):
        return check_entries(bias, MAX_LOGIT_BIAS, "token ids", _check_bias_entry)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop):
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings (got {len(stop)})")
        for text in [stop] if isinstance(stop, str) else stop or []:
            check_unicode(text)
        return stop

    # What differs between the generation routes: each route's request model (serving/
    # completions.py, serving/chat.py) defines max_tokens, best_of and logprobs, and
    # overrides these where its fields are named otherwise.

    @property
    def max_new_tokens(self) -> int | None:
        """Most tokens to generate per choice."""
        return self.max_tokens

    def requested_logprobs(self) -> tuple[int | None, str]:
        """(top logprobs per token, None for none; the field that asked for them)."""
        return self.logprobs, "logprobs"

    def requested_prompt_logprobs(self) -> tuple[int | None, str]:
        """(top logprobs per prompt token, None for none; the field that asked for them)."""
        return None, "prompt_logprobs"

    def sampling_field_names(self) -> dict[str, str]:
        """SamplingParams field -> this route's field, where they differ."""
        return {}

    def prompt_field_renames(self) -> dict[str, str]:
        """Engine error field about the prompt -> this route's field."""
        return {"prompt_token_ids": "prompt"}

    def implied_constraint_field(self) -> str:
        """The field of a constraint the route adds itself ('' for none)."""
        return ""


_TOKEN_IDS_SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
PROMPT_SCHEMAS = [
    {"type": "string", "minLength": 1},
    {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": MAX_PROMPTS},
    _TOKEN_IDS_SCHEMA,
    {"type": "array", "items": _TOKEN_IDS_SCHEMA, "minItems": 1, "maxItems": MAX_PROMPTS},
]


_SHAPE = "must be a non-empty string, list of strings, list of token ids, or list of token-id lists"


def check_prompt_shape(prompt):
    """One clear message instead of one pydantic error per member of the prompt union."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("empty prompt")
        return check_unicode(prompt)
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(_SHAPE if not isinstance(prompt, list) else "empty prompt list")
    if len(prompt) > MAX_PROMPTS and not all(_is_token(t) for t in prompt):
        raise ValueError(f"at most {MAX_PROMPTS} prompts in one request (got {len(prompt)})")
    if all(_is_token(t) for t in prompt):
        return prompt
    for item in prompt:
        if isinstance(item, str):
            if not item:
                raise ValueError("empty prompt in the list")
            check_unicode(item)
        elif isinstance(item, list):
            if not item:
                raise ValueError("empty token-id list in the list")
            if not all(_is_token(t) for t in item):
                raise ValueError("token ids must be integers")
        else:
            raise ValueError(_SHAPE)
    if len({type(item) for item in prompt}) > 1:
        raise ValueError("do not mix strings and token-id lists in one prompt list")
    return prompt


def _is_token(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_unicode(text: str) -> str:
    """JSON may escape a lone UTF-16 surrogate ("\\ud800"); no tokenizer can encode one."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"text must be valid Unicode: a lone surrogate U+{ord(text[exc.start]):04X} at index {exc.start}"
        ) from None
    return text


def check_unicode_within(value):
    """check_unicode on every string in a JSON value, dict keys included: what the chat
    template renders (names, tool calls, tool definitions) must be encodable too. A stack,
    not recursion: the body's nesting depth is the client's choice."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            check_unicode(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return value


def check_entries(mapping: dict | None, limit: int, what: str, check_entry: Callable[[Any, Any], None]) -> dict | None:
    """A bounded mapping field: at most `limit` entries (`what` names them in the error),
    each passed to `check_entry(key, value)`, which raises ValueError; None passes."""
    if mapping is None:
        return mapping
    if len(mapping) > limit:
        raise ValueError(f"at most {limit} {what} (got {len(mapping)})")
    for key, value in mapping.items():
        check_entry(key, value)
    return mapping


def _check_bias_entry(key: str, value: float) -> None:
    if not _TOKEN_ID_KEY.fullmatch(key):
        raise ValueError(f"keys must be token ids written in ASCII digits (got {ascii(key[:24])})")
    if not -100 <= value <= 100:
        raise ValueError(f"biases must be in [-100, 100] (got {value} for {key})")


def unicode_checked(*fields: str):
    """A request model's validator of `fields`: check_unicode_within each one's value.

        _check_text = unicode_checked("content", "name")   # in the class body
    """
    return field_validator(*fields)(check_unicode_within)


# --------------------------------------------------------------------------- to SamplingParams


def to_sampling_params(request: GenerationRequest, max_logprobs: int) -> SamplingParams:
    """The engine's SamplingParams for a request; SamplingParamsError names the request field."""
    logprobs, logprobs_field = request.requested_logprobs()
    prompt_logprobs, prompt_logprobs_field = request.requested_prompt_logprobs()
    for value, name in ((logprobs, logprobs_field), (prompt_logprobs, prompt_logprobs_field)):
        if value is not None and value > max_logprobs:
            raise SamplingParamsError(f"{name}: at most {max_logprobs} (got {value})")
    best_of = request.best_of if request.best_of is not None else request.n
    if request.stream and best_of > request.n:
        raise SamplingParamsError("best_of: cannot stream when best_of > n (the n kept are known only at the end)")
    if request.stream and request.use_beam_search:
        raise SamplingParamsError("use_beam_search: cannot stream beam search (beams are reordered until the end)")
    if request.stream_options is not None and not request.stream:
        raise SamplingParamsError("stream_options: only allowed when stream is true")
    if request.use_beam_search:
        _check_beam_search(request)
    temperature = request.temperature
    if temperature is None:
        temperature = 0.0 if request.use_beam_search else 1.0
    max_tokens = request.max_new_tokens
    options = {
        "n": request.n,
        "best_of": best_of,
        "use_beam_search": request.use_beam_search,
        "length_penalty": request.length_penalty,
        "early_stopping": request.early_stopping,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": _or(request.top_p, 1.0),
        "top_k": -1 if request.top_k in (None, 0) else request.top_k,
        "min_p": _or(request.min_p, 0.0),
        "presence_penalty": _or(request.presence_penalty, 0.0),
        "frequency_penalty": _or(request.frequency_penalty, 0.0),
        "repetition_penalty": _or(request.repetition_penalty, 1.0),
        "seed": request.seed,
        "stop": [request.stop] if isinstance(request.stop, str) else list(request.stop or []),
        "stop_token_ids": list(request.stop_token_ids or []),
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "ignore_eos": request.ignore_eos,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
        "skip_special_tokens": request.skip_special_tokens,
        "logit_bias": {int(k): v for k, v in (request.logit_bias or {}).items()},
        "min_tokens": request.min_tokens,
        "cache_salt": request.cache_salt,
        "priority": _or(request.priority, 0),
    }
    names = _field_names(request, logprobs_field)
    names["prompt_logprobs"] = prompt_logprobs_field
    constraint, field = requested_constraint(request)
    if constraint is not None:
        options["structured_outputs"] = constraint
        names.update(constraint_field_names(field))
    try:
        return SamplingParams(**options)
    except SamplingParamsError as exc:
        raise SamplingParamsError(_rename_field(str(exc), names)) from None


_CONSTRAINT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


def requested_constraint(request: GenerationRequest) -> tuple[dict | None, str]:
    """The output constraint the request asks for, from whichever field it used (at most
    one), and that field's name; tool_choice 'required' / named is the chat route's."""
    found: list[tuple[dict, str]] = []
    fmt = request.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(({"json_object": True}, "response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        schema = fmt.json_schema.schema_
        found.append(({"json": schema} if schema is not None else {"json_object": True}, "response_format.json_schema"))
    if request.structured_outputs is not None:
        found.append((request.structured_outputs.constraint(), "structured_outputs"))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(request, f"guided_{kind}")
        if value is not None:
            found.append(({kind: value}, f"guided_{kind}"))
    if len(found) > 1:
        raise SamplingParamsError(f"{found[1][1]}: cannot be combined with {found[0][1]} (give one constraint)")
    return found[0] if found else (None, "")


def constraint_field_names(field: str) -> dict[str, str]:
    """The engine's constraint fields -> the request field the client wrote."""
    if field == "structured_outputs":
        return {}
    if field == "response_format.json_schema":
        return {"structured_outputs": field, "structured_outputs.json": field + ".schema",
                "structured_outputs.json_object": field + ".schema"}  # fmt: skip
    return {"structured_outputs": field, **{f"structured_outputs.{kind}": field for kind in _CONSTRAINT_KINDS}}


def _check_beam_search(request: GenerationRequest) -> None:
    """Name the truncation option the client set (SamplingParams reports them all as top_p)."""
    for name, is_set in (
        ("top_p", request.top_p not in (None, 1.0)),
        ("top_k", request.top_k not in (None, 0, -1)),
        ("min_p", request.min_p not in (None, 0.0)),
    ):
        if is_set:
            raise SamplingParamsError(
                f"{name}: cannot be combined with use_beam_search (beams keep the most likely tokens; "
                "there is nothing to truncate)"
            )


def _field_names(request: GenerationRequest, logprobs_field: str) -> dict[str, str]:
    """SamplingParams field -> the request field the client set."""
    names = {"logprobs": logprobs_field}
    if request.best_of is None:
        names["best_of"] = "n"
    names.update(request.sampling_field_names())
    return names


def engine_renames(request: GenerationRequest) -> dict[str, str]:
    """Engine error field -> the request field the client wrote."""
    renames = request.prompt_field_renames()
    if request.best_of is None:
        renames["best_of"] = "n"
    try:
        _, field = requested_constraint(request)
    except SamplingParamsError:
        field = ""
    field = field or request.implied_constraint_field()
    if field:
        renames.update(constraint_field_names(field))
    return renames


def _rename_field(message: str, names: dict[str, str]) -> str:
    field = param_of(message)
    if field in names:
        return names[field] + message[len(field) :]
    return message


def _or(value, default):
    return default if value is None else value


# --------------------------------------------------------------------------- responses


def unix_now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(0, description="Prompt tokens whose K/V came from the prefix cache.")


class UsageInfo(BaseModel):
    prompt_tokens: int = Field(description="Prompt tokens (each prompt counted once, whatever n).")
    completion_tokens: int = Field(description="Tokens in the returned choices.")
    total_tokens: int = Field(description="prompt_tokens + completion_tokens.")
    prompt_tokens_details: PromptTokensDetails | None = Field(
        None, description="Only when the server reports them (enable_prompt_tokens_details), as vLLM."
    )

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> UsageInfo:
        """cached_tokens None: not reported (prompt_tokens_details is null)."""
        details = None if cached_tokens is None else PromptTokensDetails(cached_tokens=cached_tokens)
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=details,
        )


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list, description="Each generated token's text.")
    token_logprobs: list[float | None] = Field(default_factory=list, description="Each token's logprob.")
    top_logprobs: list[dict[str, float] | None] = Field(
        default_factory=list, description="Per token: the sampled and the `logprobs` most likely tokens' logprobs."
    )
    text_offset: list[int] = Field(default_factory=list, description="Where each token starts in the choice text.")


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class ResponseHead(BaseModel):
    """The fields every generation response and streamed event opens with, in OpenAI's order
    (each route's model sets `object` and adds its choices and usage after them)."""

    id: str
    object: str
    created: int = Field(default_factory=unix_now)
    model: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=unix_now)
    owned_by: str = "rayserve-paged"
    max_model_len: int | None = None
    root: str | None = None  # a LoRA adapter's directory
    parent: str | None = None  # a LoRA adapter's base model (None: a base model)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]

