"""The chat model's tensors, by name: what the server's chat model declares and the client's chat sessions send and
read (``server_models/chat/config.pbtxt`` declares exactly these; tests/test_protocol.py holds it).

Names only, no dtypes or shapes: those are the config's, and each side reads them from there (the client from the
model's config it fetches). This module imports nothing. Read as a namespace: ``from .._protocol import chat as
proto``, then ``proto.DIGEST``.
"""

# -- inputs: a turn's messages, its options, the client's digest ----------------------------------------------------
ROLE = "ROLE"  # one role per message of the turn (BYTES): system, user, assistant or tool
TEXT = "TEXT"  # one text per message, UTF-8 (BYTES)
MAX_TOKENS = "MAX_TOKENS"  # 0: no cap (the reply may run to the end of the context)
MIN_TOKENS = "MIN_TOKENS"
TEMPERATURE = "TEMPERATURE"
TOP_P = "TOP_P"
TOP_K = "TOP_K"
SEED = "SEED"
STOP = "STOP"  # strings the reply is cut before (BYTES, any count)
STREAM_INTERVAL_MS = "STREAM_INTERVAL_MS"  # a model from before it lacks the input: the client checks first
#: What the reply must be (BYTES, one JSON object): ``{"type": "json_schema", "schema": {...}, "strict": true}``,
#: ``{"type": "json_object"}``, ``{"type": "regex", "pattern": "..."}`` or ``{"type": "grammar", "syntax": "lark" |
#: "gbnf", "grammar": "..."}``. The server compiles it before the turn runs (one that does not compile is the
#: request's invalid input) and masks every token the reply may not take; the turn ends once the constraint is
#: complete. A model from before it lacks the input: the client checks first.
CONSTRAINT = "CONSTRAINT"
#: Penalties on tokens already in the reply (FP32 each): OpenAI's presence (-2..2: once a token appeared) and
#: frequency (-2..2: per time it appeared), subtracted from its logit; and the repetition penalty (0 < r <= 10, 1:
#: off; Hugging Face's): a logit of a token in the prompt or the reply divided by r where positive, times r where not.
PRESENCE_PENALTY = "PRESENCE_PENALTY"
FREQUENCY_PENALTY = "FREQUENCY_PENALTY"
REPETITION_PENALTY = "REPETITION_PENALTY"
#: In (INT32, 0..20): each reply token's log-probability, with that many most likely alternatives. Out (BYTES, JSON):
#: on each response, the entries of the tokens whose bytes it completes, ``[{"id", "b" (the token's bytes, hex),
#: "lp", "top": [[id, bytes hex, lp], ...]}]``, from the model's own distribution (before temperature, penalties and
#: constraints); the last response carries the rest.
LOGPROBS = "LOGPROBS"
#: Tools the model may call this turn (BYTES, one JSON array of OpenAI tool definitions: ``{"type": "function",
#: "function": {"name", "description", "parameters"}}``). The chat template renders them (the whole conversation is
#: rendered with the turn's tools: send the same ones every turn and the cache keeps its prefix) and the reply is
#: read for calls in the checkpoint's own format. A checkpoint whose template takes no tools refuses them.
TOOLS = "TOOLS"
#: With TOOLS (BYTES, one entry): ``auto`` (the default: the model may call tools), ``none`` (tools shown, the
#: reply is text), ``required`` (the reply is one or more calls) or ``{"type": "function", "function": {"name":
#: N}}`` (a call of N). ``required`` and a named function constrain the reply to a call whose arguments are valid
#: for the function's ``parameters`` schema.
TOOL_CHOICE = "TOOL_CHOICE"
#: Each message's tool-use fields (BYTES, one entry per ROLE entry, ``""`` for a message that has none): a JSON
#: object with any of ``tool_calls`` (an assistant's calls: ``[{"id", "name", "arguments"}]``, arguments JSON text
#: of an object), ``tool_call_id`` and ``name`` (a ``tool`` message's: the call it answers and the function's name).
TOOL_META = "TOOL_META"
#: Out (BYTES, JSON): on a turn's last response, the calls its reply made, ``[{"id", "name", "arguments"}]``
#: (``""`` when none); PIECE then carried only the reply's content (the text before the calls: never a call's
#: markup). The history keeps the reply as an assistant message with that content and these calls.
TOOL_CALLS = "TOOL_CALLS"
#: The history digest (``_digest``): an input with every turn but a START, and an output of a turn's last response.
DIGEST = "DIGEST"
#: A request of its own (BOOL true, no messages, neither START nor END) that stops the conversation's turn in flight:
#: the turn ends as a cancelled one (rolled back; its call gets an empty final response and ends normally), and the
#: request is answered by an empty final response. The client's way to stop a turn without cancelling its gRPC
#: call: Triton 2.51 crashes when such a cancellation races the responses it is writing.
CANCEL = "CANCEL"

# -- outputs: each response's piece; the last response's finish reason and counts ---------------------------------
PIECE = "PIECE"  # raw bytes that may split a UTF-8 character
FINISH = "FINISH"  # "" until the last response
TOKENS = "TOKENS"
PROMPT_TOKENS = "PROMPT_TOKENS"
CONTEXT_TOKENS = "CONTEXT_TOKENS"
DROPPED = "DROPPED"
LIVE = "LIVE"  # conversations the instance holds (an operator's probe)
KV_BYTES = "KV_BYTES"  # bytes of KV cache they hold
INPUT_TOKENS = "INPUT_TOKENS"  # a config may leave it out (one from before it): the client reads 0

#: What makes a model a chat model: the client refuses one without these.
REQUIRED_INPUTS = (ROLE, TEXT)
REQUIRED_OUTPUTS = (PIECE, FINISH)
#: The generation options' inputs, each optional: sent only when the option is set.
OPTION_INPUTS = (
    MAX_TOKENS, MIN_TOKENS, TEMPERATURE, TOP_P, TOP_K, SEED, STREAM_INTERVAL_MS, CONSTRAINT, PRESENCE_PENALTY,
    FREQUENCY_PENALTY, REPETITION_PENALTY, LOGPROBS, TOOLS, TOOL_CHOICE,
)  # fmt: skip
#: Every input and output the packaged chat model declares.
INPUTS = (*REQUIRED_INPUTS, *OPTION_INPUTS, STOP, DIGEST, CANCEL, TOOL_META)
OUTPUTS = (
    *REQUIRED_OUTPUTS, TOKENS, PROMPT_TOKENS, CONTEXT_TOKENS, DROPPED, LIVE, KV_BYTES, DIGEST, INPUT_TOKENS, LOGPROBS,
    TOOL_CALLS,
)  # fmt: skip

#: The longest stream interval the server takes: the client refuses a longer one before sending.
STREAM_INTERVAL_MAX_MS = 60000

#: The decoder families the chat model serves, by a checkpoint's ``config.json`` ``model_type``: the values of the
#: ``checkpoint`` parameter the launcher writes into a generated config and the engine loads. The client refuses
#: another before any server starts; the engine maps each to its loader (``server/chat/_families.py``, which must
#: name exactly these: tests/test_protocol.py).
MODEL_TYPES = ("gpt2", "llama", "qwen2", "mistral")
