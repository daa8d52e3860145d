"""A forward_backward call's datums checked before any trainer sees them: each wrong one named in one line."""

import numpy as np
import pytest

pytest.importorskip("tinker", reason="the tinker extra (make test installs it)")

from forge_rl.tinker.config import TinkerConfig  # noqa: E402
from forge_rl.tinker.errors import Refused  # noqa: E402
from forge_rl.tinker.training import Training  # noqa: E402
from forge_rl.tinker.wire import Datum, ForwardBackwardCall  # noqa: E402


def rows(*data: Datum, loss_fn: str = "cross_entropy"):
    training = Training(TinkerConfig(max_batch_datums=2, max_sequence_tokens=8), "unused", vocab_size=100)
    return training.rows(ForwardBackwardCall("m", loss_fn, False, list(data)), loss_fn)


def datum(tokens, targets, **inputs) -> Datum:
    arrays = {"target_tokens": np.asarray(targets, np.int64)}
    arrays.update({k: np.asarray(v, np.float32) for k, v in inputs.items()})
    return Datum(list(tokens), arrays)


def test_a_good_datum_becomes_a_row():
    (row,) = rows(datum([1, 2, 3], [2, 3, 4], weights=[1, 1, 0.5]))
    assert (row.tokens, row.targets, row.inputs["weights"].tolist()) == ([1, 2, 3], [2, 3, 4], [1.0, 1.0, 0.5])


@pytest.mark.parametrize(
    "data, message",
    [
        ([], "with no datums"),
        ([datum([1], [2], weights=[1])] * 3, "3 datums in one call, over this server's max_batch_datums=2"),
        ([datum(range(9), range(1, 10), weights=[1] * 9)], "datum 0: 9 input tokens; give 1 to max_sequence_tokens=8"),
        ([datum([1, 2], [2, 3])], r"datum 0: loss_fn_inputs lacks \['weights'\]"),
        ([datum([1, 2], [2, 3], weights=[1])], r"loss_fn_inputs\['weights'\] has 1 values for 2 input tokens"),
        ([datum([1, 2], [2, 300], weights=[1, 1])], r"a token id outside the vocabulary \[0, 100\)"),
        ([datum([1, 2], [5, 3], weights=[1, 1])], "target_tokens must be the input tokens shifted by one"),
    ],
)
def test_each_bad_datum_is_named(data, message):
    with pytest.raises(Refused, match=message) as refused:
        rows(*data)
    assert "\n" not in str(refused.value)
