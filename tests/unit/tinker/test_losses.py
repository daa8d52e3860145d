"""The Tinker losses on per-token logprobs, the settings each takes, and the service's key check."""

import pytest
import torch

pytest.importorskip("tinker", reason="the tinker extra (make test installs it)")

from forge_rl.tinker.errors import Refused  # noqa: E402
from forge_rl.tinker.losses import check_loss, token_loss  # noqa: E402
from forge_rl.tinker.server import owner_of  # noqa: E402


def test_each_loss_is_its_formula():
    lp = torch.tensor([-1.0, -2.0])
    inputs = {"weights": torch.tensor([1.0, 0.5]), "logprobs": torch.tensor([-1.0, -1.0]), "advantages": torch.ones(2)}
    assert token_loss("cross_entropy", lp, inputs, {}).tolist() == [1.0, 1.0]
    ratio = torch.exp(lp - inputs["logprobs"])
    assert torch.allclose(token_loss("importance_sampling", lp, inputs, {}), -ratio)
    settings = check_loss("ppo", {"clip_low_threshold": 0.9})
    assert torch.allclose(token_loss("ppo", lp, inputs, settings), -torch.minimum(ratio, ratio.clamp(0.9, 1.2)))


@pytest.mark.parametrize(
    "loss_fn, config, message",
    [
        ("dro", {}, "loss_fn='dro' is not served"),
        ("cross_entropy", {"beta": 1.0}, r"\['beta'\] are not settings of 'cross_entropy'"),
        ("ppo", {"clip_high_threshold": 0.5}, "clip_low_threshold <= 1 <= clip_high_threshold"),
    ],
)
def test_a_loss_or_setting_not_served_is_refused_by_name(loss_fn, config, message):
    with pytest.raises(Refused, match=message):
        check_loss(loss_fn, config)


def test_only_a_known_key_names_a_user():
    keys = {"tml-a": "user-0", "tml-b": "user-1"}
    assert [owner_of(keys, k) for k in ("tml-a", "tml-b", "tml-c", None)] == ["user-0", "user-1", None, None]
