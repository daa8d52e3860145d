"""The Tinker protocol's binary bodies, read and written with the message classes the `tinker` client ships
(`tinker.proto.tinker_public_pb2`): a forward_backward request in, its output and a sample's response out. Every
other body is JSON, read with the client's own pydantic types (forge_rl/tinker/server.py).

Only what the service serves is read: text chunks (an image or audio chunk is refused by name) and dense tensors.
"""

from dataclasses import dataclass, field

import numpy as np

from forge_rl.errors import ConfigError
from forge_rl.tinker.errors import Refused

try:
    from tinker.proto import tinker_public_pb2 as pb
except ImportError:  # the optional extra: say how to get it, in one line
    raise ConfigError("the Tinker service needs the tinker client: pip install -e '.[tinker]'") from None

_DTYPES = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


@dataclass
class Datum:
    """One sequence of a forward_backward call: its input tokens and its loss inputs, each a flat array."""

    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class ForwardBackwardCall:
    model_id: str
    loss_fn: str
    forward_only: bool
    data: list[Datum]
    loss_config: dict[str, float | str] = field(default_factory=dict)


def _tensor(msg, name: str) -> np.ndarray:
    if msg.HasField("sparse_csr"):
        raise Refused(f"loss_fn_inputs[{name!r}] is sparse: this server takes dense tensors; send a dense one")
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        raise Refused(f"loss_fn_inputs[{name!r}] has dtype {pb.DType.Name(msg.dtype)}: send float32 or int64")
    return np.frombuffer(msg.dense, dtype=dtype).copy()


def _tokens(chunks) -> list[int]:
    tokens: list[int] = []
    for chunk in chunks:
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise Refused(f"a model_input chunk of kind {kind!r}: this server takes text (encoded_text) chunks only")
        tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
    return tokens


def read_forward_backward(body: bytes) -> ForwardBackwardCall:
    """A forward_backward request's protobuf body, as plain Python and numpy."""
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # a body the client did not make
        raise Refused(f"forward_backward: the body is not a ForwardBackwardRequest message ({e})") from None
    config: dict[str, float | str] = {k: v for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    data = [
        Datum(_tokens(d.model_input), {name: _tensor(t, name) for name, t in d.loss_fn_inputs.items()})
        for d in msg.data
    ]
    return ForwardBackwardCall(msg.model_id, msg.loss_fn, msg.forward_only, data, config)


def _batched(arrays: list[np.ndarray], dtype: int) -> "pb.BatchedTensor":
    """Per-datum arrays as one BatchedTensor: the bytes end to end, with each datum's byte offset."""
    offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
    return pb.BatchedTensor(data=b"".join(a.tobytes() for a in arrays), offsets=offsets.tobytes(), dtype=dtype)


def forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A ForwardBackwardOutput message: each datum's float32 outputs (its per-token logprobs) and the metrics."""
    record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(outputs))
    for name in outputs[0] if outputs else ():
        record.fields[name].CopyFrom(_batched([o[name].astype(np.float32) for o in outputs], pb.DTYPE_FLOAT32))
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", metrics=metrics)
    if outputs:
        msg.loss_fn_outputs.append(record)
    return msg.SerializeToString()


@dataclass
class Sequence:
    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # an end-of-sequence or stop token ended it (else max_tokens did)


def sample_response(sequences: list[Sequence], prompt_logprobs: list[float] | None = None) -> bytes:
    """A SampleResponse message. `prompt_logprobs` has NaN for the first token, which has no logprob."""
    msg = pb.SampleResponse()
    for s in sequences:
        msg.sequences.append(
            pb.SampledSequence(
                stop_reason=pb.STOP_REASON_STOP if s.stopped else pb.STOP_REASON_LENGTH,
                tokens=np.asarray(s.tokens, dtype=np.int32).tobytes(),
                logprobs=np.asarray(s.logprobs, dtype=np.float32).tobytes(),
            )
        )
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
