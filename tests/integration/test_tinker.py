"""The Tinker-compatible service (forge_rl/tinker/) against the real `tinker` client, unpatched: one service
(`python -m apps.tinker.main`, its trainer and vLLM generator) for every test of the module, one training client
shared by the tests that train. An SFT loop whose loss falls, an RL step with importance_sampling, sampled
logprobs equal to the trainer's, and each bad input refused in one line while the service keeps serving."""

import contextlib
import json
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from tests.conftest import REPO

tinker = pytest.importorskip("tinker", reason="the tinker extra (pip install -e '.[tinker]'; make test installs it)")
from tinker import types  # noqa: E402

MAX_DATUMS = 16


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """The service as a user starts it, on a free port with a key of its own; stopped with Ctrl-C (SIGINT)."""
    out = tmp_path_factory.mktemp("tinker")
    log = open(out / "service.log", "w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "apps.tinker.main", "--config", "configs/tinker/tiny.yaml", f"output_dir={out}"]
        + [f"max_batch_datums={MAX_DATUMS}", "max_sequence_tokens=64", "extra_users=1", "max_training_clients=12"],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 240
    while not (out / "service.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the service did not start: {(out / 'service.log').read_text()[-3000:]}")
        time.sleep(0.5)
    time.sleep(0.2)  # the file is written whole before the line is printed; let the write land
    yield json.loads((out / "service.json").read_text())
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


@pytest.fixture(scope="module")
def connect(service):
    """`connect(key)`: a ServiceClient of this module's service, closed (its session finished, its heartbeat thread
    stopped) before the service stops, so no client keeps calling a service that is gone."""
    with contextlib.ExitStack() as opened:
        yield lambda key: opened.enter_context(tinker.ServiceClient(base_url=service["base_url"], api_key=key))


@pytest.fixture(scope="module")
def client(service, connect):
    return connect(service["api_key"])


@pytest.fixture(scope="module")
def training(client):
    return client.create_lora_training_client(base_model="tiny", rank=8).result()


def datum(ids: list[int], **inputs) -> types.Datum:
    """Next-token prediction on `ids`: input ids[:-1], targets ids[1:]; the loss inputs per target token."""
    arrays = {"target_tokens": np.array(ids[1:], dtype=np.int64)}
    arrays.update({k: np.asarray(v, dtype=np.float32) for k, v in inputs.items()})
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=arrays)


def sft_data(tokenizer) -> list[types.Datum]:
    texts = ["12+34=46", "20+31=51", "7+8=15", "40+40=80"]
    return [datum(ids, weights=np.ones(len(ids) - 1)) for ids in (tokenizer.encode(t) for t in texts)]


def test_capabilities_name_the_base_model(client):
    caps = tinker.RestClient(base_url=client._base_url, api_key=client._api_key).get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == ["tiny"]


def test_sft_loop_lowers_the_loss(training):
    data = sft_data(training.get_tokenizer())
    losses = []
    for _ in range(8):
        result = training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        losses.append(result.metrics["loss:sum"])
    assert [len(o["logprobs"].tolist()) for o in result.loss_fn_outputs] == [d.model_input.length for d in data]
    assert losses[-1] < 0.8 * losses[0], losses


def test_a_custom_loss_runs_through_the_client(training):
    """The client's own custom-loss path: a forward, the loss on the client, its gradient sent back as weights."""
    data = sft_data(training.get_tokenizer())

    def mean_nll(batch, logprobs_list):
        loss = -sum(lp.sum() for lp in logprobs_list) / sum(len(lp) for lp in logprobs_list)
        return loss, {"mean_nll": float(loss.detach())}

    result = training.forward_backward_custom(data, mean_nll).result()
    training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert np.isfinite(result.metrics["mean_nll"]) and result.metrics["mean_nll"] > 0


def test_sampled_logprobs_equal_the_trainers(training):
    """Sampled at temperature 1, each token's logprob from vLLM equals the trainer's on the same weights (fp32)."""
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = training.get_tokenizer().encode("12+34=")
    res = sampler.sample(
        types.ModelInput.from_ints(prompt), num_samples=4, sampling_params=types.SamplingParams(max_tokens=8)
    ).result()
    assert len(res.sequences) == 4
    data = [datum(prompt + s.tokens, weights=np.zeros(len(prompt) + len(s.tokens) - 1)) for s in res.sequences]
    forward = training.forward(data, "cross_entropy").result()
    gaps = [
        np.abs(out["logprobs"].to_numpy()[len(prompt) - 1 :] - np.asarray(s.logprobs)).mean()
        for out, s in zip(forward.loss_fn_outputs, res.sequences)
    ]
    assert max(gaps) < 1e-4, gaps
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + res.sequences[0].tokens)).result()
    assert scored[0] is None and np.abs(np.asarray(scored[len(prompt) :]) - res.sequences[0].logprobs).max() < 1e-4
    last = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + res.sequences[0].tokens), 2).result()
    assert last[:-2] == [None] * (len(last) - 2) and last[-2:] == pytest.approx(scored[-2:], abs=1e-6)
    with pytest.raises(tinker.RequestFailedError, match="sampling with topk_sample_logprobs is not served"):
        sampler.sample(
            types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=2), topk_sample_logprobs=3
        ).result()


def test_rl_step_with_importance_sampling(training):
    """Sample a group, score it, train on it with importance_sampling: the step runs and moves the weights."""
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = training.get_tokenizer().encode("20+31=")
    res = sampler.sample(
        types.ModelInput.from_ints(prompt), num_samples=8, sampling_params=types.SamplingParams(max_tokens=6)
    ).result()
    rewards = np.array([float(s.tokens[:1] == training.get_tokenizer().encode("5")) for s in res.sequences])
    advantages = rewards - rewards.mean() + np.linspace(-0.1, 0.1, len(rewards))  # never all zero
    data = []
    for s, adv in zip(res.sequences, advantages):
        n = len(prompt) + len(s.tokens) - 1
        behaviour = np.concatenate([np.zeros(len(prompt) - 1), s.logprobs])
        weight = np.concatenate([np.zeros(len(prompt) - 1), np.full(len(s.tokens), adv)])
        data.append(datum(prompt + s.tokens, logprobs=behaviour[:n], advantages=weight[:n]))
    result = training.forward_backward(data, "importance_sampling").result()
    assert np.isfinite(result.metrics["loss:sum"])
    step = training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert step.metrics["grad_norm:mean"] > 0
    ids = prompt + res.sequences[0].tokens
    scored = training.forward([datum(ids, weights=np.zeros(len(ids) - 1))], "cross_entropy").result()
    after = scored.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.abs(after[len(prompt) - 1 :] - res.sequences[0].logprobs).max() > 1e-4


def test_a_saved_state_resumes_bitwise(client, training):
    """save_state, two more steps; a new client from that state (weights, Adam's moments, the step) takes the same
    two steps to the same losses, bit for bit."""
    data = sft_data(training.get_tokenizer())
    path = training.save_state("resume").result().path

    def two_steps(trainer) -> list[float]:
        losses = []
        for _ in range(2):
            losses.append(trainer.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
            trainer.optim_step(types.AdamParams(learning_rate=5e-3)).result()
        return losses

    listed = tinker.RestClient(base_url=client._base_url, api_key=client._api_key).list_checkpoints(training.model_id)
    assert path in [c.tinker_path for c in listed.result().checkpoints]
    first = two_steps(training)
    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    assert two_steps(resumed) == first
    weights_only = client.create_training_client_from_state(path).result()  # Adam's moments start again
    assert weights_only.forward(data, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(first[0], rel=1e-6)
    with pytest.raises(tinker.RequestFailedError, match="no saved state at 'tinker://nowhere/weights/x'"):
        client.create_training_client_from_state("tinker://nowhere/weights/x").result()


def test_another_users_key_sees_nothing_of_this_user(service, connect, training):
    """The second user's key is a key of the service, but this user's models, saved weights and requests are
    as unknown to it as ones that do not exist."""
    other = connect(service["other_users"][0])
    path = training.save_weights_for_sampler("mine").result().path
    with pytest.raises(tinker.BadRequestError, match="no saved weights at"):
        other.create_sampling_client(model_path=path).result()
    headers = {"X-API-Key": service["other_users"][0]}
    body = {"model_id": training.model_id, "adam_params": {"learning_rate": 1.0}}
    promise = httpx.post(f"{service['base_url']}/api/v1/optim_step", json=body, headers=headers).json()
    answer = httpx.post(f"{service['base_url']}/api/v1/retrieve_future", json=promise, headers=headers).json()
    assert "no training client" in answer["error"] and answer["category"] == "user"


def test_two_users_sample_their_own_adapters_on_one_generator(service, connect, training):
    """Every training client's newest adapter stays on the service's one generator: another user's saved weights
    neither make this user's sampling client stale nor change what it samples, and that user's failing call, made
    at the same time, leaves this user's sample running. /healthz counts one vLLM engine and one trainer for both."""
    other = connect(service["other_users"][0])
    theirs = other.create_lora_training_client(base_model="tiny", rank=8).result()
    tokenizer = training.get_tokenizer()
    prompt = types.ModelInput.from_ints(tokenizer.encode("12+34=")[:5])
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    mine = training.save_weights_and_get_sampling_client().result()
    before = mine.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
    theirs.forward_backward(sft_data(tokenizer), "cross_entropy").result()
    theirs.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    their_sampler = theirs.save_weights_and_get_sampling_client().result()
    failing = theirs.forward_backward(sft_data(tokenizer) * MAX_DATUMS, "cross_entropy")
    after = mine.sample(prompt, num_samples=1, sampling_params=greedy)
    their_sample = their_sampler.sample(prompt, num_samples=1, sampling_params=greedy)
    with pytest.raises(tinker.RequestFailedError, match="max_batch_datums"):
        failing.result()
    after, their_sample = after.result().sequences[0], their_sample.result().sequences[0]
    assert after.tokens == before.tokens
    np.testing.assert_allclose(after.logprobs, before.logprobs, atol=1e-5)
    assert (
        their_sample.tokens != before.tokens or np.abs(np.subtract(their_sample.logprobs, before.logprobs)).max() > 1e-3
    )
    health = httpx.get(f"{service['base_url']}/api/v1/healthz", headers={"X-API-Key": service["api_key"]}).json()
    assert health["by_name"]["VLLM::EngineCore"]["processes"] == 1 and health["adapters_served"] >= 2
    trainers = sum(e["processes"] for name, e in health["by_name"].items() if name.startswith("forge:trainer"))
    assert trainers == 1 < health["training_clients"]  # every client's adapters on one trainer process
    other.close("success").result()  # its trainer stopped, its slot free


def test_clients_sharing_the_trainer_train_as_if_alone(client):
    """Two training clients on the one trainer, their calls interleaved (the other's forward_backward between one's
    forward_backward and its optim_step): the first takes the same steps to the same losses, bit for bit, as a
    client training alone; neither's gradients nor Adam's moments reach the other."""
    alone, first, second = (client.create_lora_training_client(base_model="tiny", rank=8).result() for _ in range(3))
    tokenizer = alone.get_tokenizer()
    data, other = sft_data(tokenizer), sft_data(tokenizer)[::-1][:2]
    adam = types.AdamParams(learning_rate=5e-3)

    def step(trainer, batch) -> float:
        loss = trainer.forward_backward(batch, "cross_entropy").result().metrics["loss:sum"]
        trainer.optim_step(adam).result()
        return loss

    expected = [step(alone, data) for _ in range(3)]
    losses = []
    for _ in range(3):
        mine = first.forward_backward(data, "cross_entropy")
        second.forward_backward(other, "cross_entropy").result()
        losses.append(mine.result().metrics["loss:sum"])
        first.optim_step(adam).result()
        second.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    assert losses == expected and losses[-1] < losses[0]


def test_a_wrong_key_is_refused_by_the_clients_auth_error(connect):
    wrong = connect("tml-not-the-key")
    with pytest.raises(tinker.AuthenticationError, match="invalid API key"):
        wrong.create_lora_training_client(base_model="tiny", rank=8).result()


def _bad_calls(client, training):
    ids = training.get_tokenizer().encode("12+34=46")
    short = types.Datum(
        model_input=types.ModelInput.from_ints(ids[:-1]),
        loss_fn_inputs={"target_tokens": np.array(ids[1:3]), "weights": np.ones(2, dtype=np.float32)},
    )
    good = datum(ids, weights=np.ones(len(ids) - 1))
    return {
        "unknown base model 'Qwen/Qwen3-8B'": lambda: client.create_lora_training_client(base_model="Qwen/Qwen3-8B"),
        "loss_fn='dro' is not served": lambda: training.forward_backward([good], "dro"),
        "has 2 values for 7 input tokens": lambda: training.forward_backward([short], "cross_entropy"),
        f"over this server's max_batch_datums={MAX_DATUMS}": lambda: training.forward_backward(
            [good] * (MAX_DATUMS + 1), "cross_entropy"
        ),
    }


def test_bad_inputs_are_one_line_and_the_service_keeps_serving(client, training):
    ids = training.get_tokenizer().encode("7+8=15")
    for cause, call in _bad_calls(client, training).items():
        with pytest.raises(tinker.RequestFailedError) as refused:
            call().result()
        assert cause in str(refused.value) and "\n" not in str(refused.value), str(refused.value)
        result = training.forward([datum(ids, weights=np.ones(len(ids) - 1))], "cross_entropy").result()
        assert np.isfinite(result.metrics["loss:sum"])


def test_a_save_stays_servable_until_kept_saves_newer_ones_replace_it(training):
    """A sampling client of the previous save samples exactly those weights after the training client trained and
    saved again (what tinker-cookbook's async mode does); once `kept_saves` (4) newer saves replace it, it is stale
    and refused, and the newest one samples."""
    tokenizer = training.get_tokenizer()
    prompt = types.ModelInput.from_ints(tokenizer.encode("12+34=")[:5])
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    older = training.save_weights_and_get_sampling_client().result()
    before = older.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
    training.forward_backward(sft_data(tokenizer), "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    newer = training.save_weights_and_get_sampling_client().result()
    again = older.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
    trained = newer.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences[0]
    assert again.tokens == before.tokens
    np.testing.assert_allclose(again.logprobs, before.logprobs, atol=1e-5)
    assert trained.tokens != before.tokens or np.abs(np.subtract(trained.logprobs, before.logprobs)).max() > 1e-3
    for _ in range(3):
        newest = training.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.RequestFailedError, match="stale sampling client.*4 newer saves"):
        older.sample(prompt, num_samples=1, sampling_params=greedy).result()
    with pytest.raises(tinker.RequestFailedError, match="num_samples=2 at temperature 0"):
        newest.sample(prompt, num_samples=2, sampling_params=greedy).result()  # refused in one line, as bad input
    assert len(newest.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences) == 1


def test_an_operation_not_served_is_refused_by_name(training):
    with pytest.raises(tinker.NotFoundError, match="/api/v1/save_weights_external is not served by forge_rl"):
        training.save_weights_external("first").result()


def _cookbook(script: str, service_json, out, *options: str) -> list[dict]:
    """examples/tinker/`script`, a loop of tinker-cookbook's run unchanged, writing into `out`; the rows of its
    metrics.jsonl."""
    command = [sys.executable, f"examples/tinker/{script}", "--service-json", str(service_json), "--out", str(out)]
    done = subprocess.run([*command, *options], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert "Training completed successfully" in done.stderr + done.stdout
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture
def service_json(service, tmp_path):
    pytest.importorskip("tinker_cookbook", reason="tinker-cookbook (make setup-extras installs it)")
    path = tmp_path / "service.json"
    path.write_text(json.dumps(service))
    return path


def test_tinker_cookbooks_rl_loop_runs_unchanged_and_resumes(service, service_json, tmp_path):
    """tinker-cookbook's own RL training code (rl.train.main) on the addition task written as a cookbook environment:
    it names the model by its local path (the tokenizer loads offline), samples groups, trains with
    importance_sampling on the sampler's logprobs, which equal the trainer's (the cookbook's own KL between them),
    evaluates, and saves its final checkpoint, which the REST listing holds. Run again with more steps, the cookbook
    finds that checkpoint and resumes from it (weights and Adam's state) at the next step."""
    out = tmp_path / "rl"
    sizes = ["--batch", "4", "--group", "4", "--eval-every", "2", "--eval-size", "8", "--max-tokens", "4"]
    rows = _cookbook("cookbook_rl_addition.py", service_json, out, *sizes, "--steps", "3")
    assert [r["step"] for r in rows if "env/all/reward/total" in r] == [0, 1, 2]
    assert [r["step"] for r in rows if "held_out/greedy_accuracy" in r] == [0, 2, 3]
    for row in rows:
        if "optim/kl_sample_train_v1" in row:
            assert abs(row["optim/kl_sample_train_v1"]) < 1e-4 and abs(row["optim/kl_sample_train_v2"]) < 1e-4, row
    final = [json.loads(line) for line in (out / "checkpoints.jsonl").read_text().splitlines()][-1]
    training_run = final["state_path"].removeprefix("tinker://").split("/")[0]
    rest = tinker.RestClient(base_url=service["base_url"], api_key=service["api_key"])
    assert final["state_path"] in [c.tinker_path for c in rest.list_checkpoints(training_run).result().checkpoints]
    resumed = _cookbook("cookbook_rl_addition.py", service_json, out, *sizes, "--steps", "5")
    assert [r["step"] for r in resumed if "env/all/reward/total" in r][-2:] == [3, 4]
    assert "Resumed training from " + final["state_path"] in (out / "logs.log").read_text()


def test_tinker_cookbooks_sft_loop_lowers_the_loss(service_json, tmp_path):
    """tinker-cookbook's own SFT training code (supervised.train.main) on a JSONL file of addition conversations, read
    by the cookbook's FromConversationFileBuilder: six steps of cross_entropy on the assistant's tokens lower the
    mean NLL."""
    options = ["--examples", "96", "--batch", "16", "--eval-size", "0"]
    nll = [r["train_mean_nll"] for r in _cookbook("cookbook_sft_addition.py", service_json, tmp_path, *options)]
    assert len(nll) == 6 and nll[-1] < nll[0] - 0.2, nll
