"""The Tinker protocol's binary bodies: what the `tinker` client encodes, forge_rl/tinker/wire.py reads, and what it
writes, the client decodes, value for value (the client's own converters on the other side)."""

import numpy as np
import pytest

tinker = pytest.importorskip("tinker", reason="the tinker extra (make test installs it)")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response  # noqa: E402

from forge_rl.tinker.errors import Refused  # noqa: E402
from forge_rl.tinker.wire import Sequence, forward_backward_output, read_forward_backward, sample_response  # noqa: E402


def request(data, loss_fn="ppo", config=None) -> bytes:
    fb = types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=config)
    msg = forward_backward_request_to_proto(types.ForwardBackwardRequest(forward_backward_input=fb, model_id="m-1"))
    msg.forward_only = True
    return msg.SerializeToString()


def test_a_forward_backward_request_reads_as_the_client_sent_it():
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([5, 6, 7]),
        loss_fn_inputs={"target_tokens": np.array([6, 7, 8]), "advantages": np.array([0.5, -1.0, 2.0], np.float32)},
    )
    call = read_forward_backward(request([datum, datum], config={"clip_low_threshold": 0.7}))
    assert (call.model_id, call.loss_fn, call.forward_only, call.loss_config) == (
        "m-1",
        "ppo",
        True,
        {"clip_low_threshold": pytest.approx(0.7)},
    )
    assert [d.tokens for d in call.data] == [[5, 6, 7]] * 2
    assert call.data[0].inputs["target_tokens"].tolist() == [6, 7, 8]
    assert call.data[1].inputs["advantages"].tolist() == [0.5, -1.0, 2.0]


def test_a_body_that_is_not_a_request_is_refused_in_one_line():
    with pytest.raises(Refused, match="not a ForwardBackwardRequest"):
        read_forward_backward(b"\xff\xff\xff")


def test_outputs_and_samples_decode_in_the_client():
    outputs = [{"logprobs": np.array([-1.0, -2.0], np.float32)}, {"logprobs": np.array([-0.5], np.float32)}]
    decoded = deserialize_forward_backward_output(forward_backward_output(outputs, {"loss:sum": 3.5}))
    assert decoded.metrics == {"loss:sum": 3.5}
    assert [o["logprobs"].tolist() for o in decoded.loss_fn_outputs] == [[-1.0, -2.0], [-0.5]]
    sequences = [Sequence([4, 5], [-0.25, -0.5], True), Sequence([9], [-1.5], False)]
    sample = deserialize_sample_response(sample_response(sequences, [float("nan"), -2.0]))
    assert [(s.tokens, s.logprobs, s.stop_reason) for s in sample.sequences] == [
        ([4, 5], [-0.25, -0.5], "stop"),
        ([9], [-1.5], "length"),
    ]
    assert sample.prompt_logprobs == [None, -2.0]
