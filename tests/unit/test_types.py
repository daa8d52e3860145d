import pickle

import pytest
import torch

from forge_rl.types import Completion, Episode, Group, TrainBatch


def completion(prompt=(1, 5, 6), response=(7, 8), versions=(3, 4)) -> Completion:
    return Completion(
        prompt_ids=torch.tensor(prompt),
        response_ids=torch.tensor(response),
        logprobs=torch.tensor([-0.5] * len(response)),
        policy_versions=torch.tensor(versions),
        finish_reason="stop",
        text="ab",
    )


def test_completion_checks_lengths_and_reports_oldest_version():
    assert completion(versions=(5, 3)).oldest_version == 3
    with pytest.raises(ValueError, match="policy_versions has 1 entries for 2 response tokens"):
        completion(versions=(3,))


def test_group_rejects_mixed_prompts():
    with pytest.raises(ValueError, match="episode 1 has a different prompt"):
        Group("p0", [Episode(completion()), Episode(completion(prompt=(1, 9)))])
    with pytest.raises(ValueError, match="no episodes"):
        Group("p0", [])
    g = Group("p0", [Episode(completion(versions=(4, 4))), Episode(completion(versions=(2, 5)))])
    assert len(g) == 2 and g.oldest_version == 2


def test_collate_aligns_response_fields_with_tokens():
    eps = [
        Episode(completion(), advantage=1.0),
        Episode(completion(prompt=(1,), response=(9, 9, 9), versions=(1, 1, 2)), advantage=-1.0),
    ]
    b = TrainBatch.collate(eps, pad_id=0, pad_to_multiple=8)
    assert b.tokens.shape == (2, 8)
    assert b.tokens[0, :5].tolist() == [1, 5, 6, 7, 8] and b.tokens[0, 5:].eq(0).all()
    assert b.response_mask[0].tolist() == [False, False, False, True, True, False, False, False]
    assert b.policy_versions[1, :4].tolist() == [-1, 1, 1, 2]
    assert b.behaviour_logprobs[1, 1:4].tolist() == [-0.5] * 3 and b.behaviour_logprobs[1, 0] == 0
    assert b.advantages.tolist() == [1.0, -1.0] and b.num_response_tokens == 5
    with pytest.raises(ValueError, match="episode 0 has no advantage"):
        TrainBatch.collate([Episode(completion())], pad_id=0)


def test_types_pickle_compactly():
    eps = [
        Episode(
            completion(prompt=tuple(range(100)), response=tuple(range(i, i + 1000)), versions=(i,) * 1000),
            advantage=0.5,
        )
        for i in range(8)
    ]
    raw = sum(
        t.nbytes
        for e in eps
        for t in (
            e.completion.prompt_ids,
            e.completion.response_ids,
            e.completion.logprobs,
            e.completion.policy_versions,
        )
    )
    blob = pickle.dumps(Group("p", eps))
    assert len(blob) < 1.2 * raw  # tensors pickle as raw buffers, not one object per token
    again = pickle.loads(blob)
    assert torch.equal(again.episodes[3].completion.response_ids, eps[3].completion.response_ids)


def _monarch_round_trip(obj):
    """Through the pickler Monarch uses for endpoint arguments and results."""
    import io

    from monarch._src.actor.pickle import torch_dump, torch_loads

    buf = io.BytesIO()
    torch_dump(obj, buf)
    return torch_loads(buf.getvalue()), len(buf.getvalue())


def test_tensors_cross_monarch_as_numpy_and_come_back_as_writable_tensors():
    group = Group("p0", [Episode(completion(), reward=1.0, advantage=0.5) for _ in range(4)])
    back, _ = _monarch_round_trip(group)
    for ep in back.episodes:
        c, ref = ep.completion, completion()
        for name in ("prompt_ids", "response_ids", "logprobs", "policy_versions"):
            got, want = getattr(c, name), getattr(ref, name)
            assert type(got) is torch.Tensor and got.dtype == want.dtype and torch.equal(got, want)
        c.logprobs += 1.0  # writable: the trainer and buffer may change them in place
    batch = TrainBatch.collate(back.episodes, pad_id=0)
    batch.ref_logprobs = torch.zeros(batch.tokens.shape, dtype=torch.bfloat16)  # numpy has no bfloat16
    (out,), _ = _monarch_round_trip([batch])
    assert out.response_mask.dtype == torch.bool and torch.equal(out.tokens, batch.tokens)
    assert out.ref_logprobs.dtype == torch.bfloat16


def test_a_view_sends_only_its_own_elements():
    # Monarch's tensor pickling sends a view's whole storage; numpy sends the view's elements.
    big = torch.arange(100_000)
    view = Completion(big[:3], big[3:5], torch.zeros(2), big[5:7], "stop")
    back, size = _monarch_round_trip(view)
    assert size < 4_000 and torch.equal(back.response_ids, torch.tensor([3, 4]))
