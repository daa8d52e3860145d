import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

import pytest

from forge_rl.config import ConfigError, load_config, parse_args, to_yaml
from tests.conftest import REPO
from tests.support.shipped_configs import SHIPPED, check_shipped_config, needs_no_integration
from tests.support.wrong_types import WRONG


@dataclass
class Trainer:
    lr: float = 1e-3
    steps: int = 10


@dataclass
class App:
    model: str  # required
    group_size: int = 4
    batch_size: int = 8
    trainer: Trainer = field(default_factory=Trainer)
    engine_args: dict[str, Any] = field(default_factory=dict)


@pytest.fixture
def cfg_file(tmp_path):
    path = tmp_path / "app.yaml"
    path.write_text(
        "model: tiny\ngroup_size: 8\nbatch_size: ${group_size}\ntrainer:\n  lr: 0.1\n"
        "engine_args:\n  max_model_len: 64\n"
    )
    return path


def test_file_overrides_and_interpolation(cfg_file):
    cfg = load_config(App, cfg_file, ["trainer.steps=3", "group_size=16"])
    assert isinstance(cfg, App) and isinstance(cfg.trainer, Trainer)
    assert cfg.trainer == Trainer(lr=0.1, steps=3)
    assert cfg.batch_size == 16  # ${group_size} resolves after the override
    assert cfg.engine_args == {"max_model_len": 64}  # dict fields pass any keys through


def test_unknown_key_in_file_names_key_file_and_closest(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: m\ntrainer:\n  lrate: 0.1\n")
    with pytest.raises(ConfigError) as e:
        load_config(App, path)
    msg = str(e.value)
    assert "'trainer.lrate'" in msg and str(path) in msg and "'trainer.lr'" in msg


def test_unknown_key_in_override_names_override(cfg_file):
    with pytest.raises(ConfigError, match=r"unknown config key 'grup_size' in command-line override.*'group_size'"):
        load_config(App, cfg_file, ["grup_size=2"])


def test_unknown_key_without_close_match_lists_valid_keys(cfg_file):
    with pytest.raises(ConfigError, match=r"valid keys here: 'trainer.lr', 'trainer.steps'"):
        load_config(App, cfg_file, ["trainer.zzz=1"])


def test_wrong_type_names_key_and_expected_type(tmp_path, cfg_file):
    with pytest.raises(ConfigError, match=r"'trainer.steps' in command-line override .* expects int, got 'abc'"):
        load_config(App, cfg_file, ["trainer.steps=abc"])
    path = tmp_path / "t.yaml"
    path.write_text("model: m\ntrainer:\n  lr: fast\n")
    with pytest.raises(ConfigError, match=rf"'trainer.lr' in file {path} expects float, got 'fast'"):
        load_config(App, path)


def test_missing_required_key_named():
    with pytest.raises(ConfigError, match=r"missing required config key 'model'"):
        load_config(App, None, ["group_size=2"])


def test_bad_interpolation_and_bad_files(tmp_path):
    with pytest.raises(ConfigError, match=r"'batch_size'.*nope"):
        load_config(App, None, ["model=m", "batch_size=${nope}"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(App, tmp_path / "missing.yaml")
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(App, tmp_path / "list.yaml")
    with pytest.raises(ConfigError, match="not of the form key=value"):
        load_config(App, None, ["model"])


@pytest.mark.parametrize(
    "text, override, where",
    [
        ("model: m\nengine_args: {a: 1\n", None, "line 3, column 1"),
        (None, "engine_args={name: x", "line 2, column 1"),
        (None, "engine_args=[1, 2", "line 2, column 1"),
        (None, "model=a: b: c", "line 1, column 5"),
    ],
)
def test_yaml_that_does_not_parse_is_one_line_naming_line_and_column(tmp_path, text, override, where):
    path = None
    if text is not None:
        path = tmp_path / "broken.yaml"
        path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(App, path, [override] if override else ["model=m"])
    message = str(e.value)
    assert "\n" not in message and where in message, message
    assert (str(path) if path else repr(override)) in message and "not valid YAML" in message


@pytest.mark.parametrize(
    "override, expects", [("engine_args=[]", "expects a mapping, got a list"), ("trainer={}", None)]
)
def test_a_list_for_a_mapping_is_one_line_naming_the_key(override, expects):
    if expects is None:  # an empty mapping for a mapping merges as nothing
        assert load_config(App, None, ["model=m", override]).trainer == Trainer()
        return
    with pytest.raises(ConfigError, match=rf"config key 'engine_args' in command-line override .* {expects}"):
        load_config(App, None, ["model=m", override])


@dataclass
class Stage:
    name: str = ""
    lr: float = 0.1
    steps: int = 1
    options: dict[str, Any] = field(default_factory=dict)


@dataclass
class Plan:
    stages: list[Stage] = field(default_factory=lambda: [Stage("warmup"), Stage("main")])
    sizes: list[int] = field(default_factory=lambda: [1, 2])


@dataclass
class WithLists:
    plan: Plan = field(default_factory=Plan)
    optional_plan: Plan | None = None


@pytest.mark.parametrize(
    "text, override, key, expects, got",
    [
        (
            "plan:\n  stages:\n    - {name: a}\n    - {name: b, lr: fast}\n",
            None,
            "plan.stages[1].lr",
            "float",
            "'fast' (str)",
        ),
        (None, "plan.stages[1].lr=fast", "plan.stages[1].lr", "float", "'fast' (str)"),
        (None, "plan.stages.0.steps=1.5", "plan.stages[0].steps", "int", "1.5 (float)"),
        (None, "plan.stages=[{name: a, steps: x}]", "plan.stages[0].steps", "int", "'x' (str)"),
        (None, "plan.stages=[{name: a}, {name: b, lr: [1]}]", "plan.stages[1].lr", "float", "a list"),
        (None, "plan.stages=[{name: a, options: [1]}]", "plan.stages[0].options", "a mapping", "a list"),
        (None, "plan.stages[0].options=abc", "plan.stages[0].options", "a mapping", "'abc' (str)"),
        (None, "plan.stages=[{name: a}, abc]", "plan.stages[1]", "a mapping", "'abc' (str)"),
        (None, "plan.stages[1]=null", "plan.stages[1]", "a mapping", "null"),
        (None, "plan.stages=abc", "plan.stages", "a list of mappings", "'abc' (str)"),
        (None, "plan.sizes=[1, x]", "plan.sizes[1]", "int", "'x' (str)"),
        (None, "plan.sizes=x", "plan.sizes", "a list of int", "'x' (str)"),
        (None, "plan=abc", "plan", "a mapping", "'abc' (str)"),
        (None, "optional_plan=[1]", "optional_plan", "a mapping", "a list"),
        (None, "optional_plan.stages=[{lr: x}]", "optional_plan.stages[0].lr", "float", "'x' (str)"),
    ],
)
def test_a_wrong_type_in_a_list_entry_names_its_whole_path_and_the_type(tmp_path, text, override, key, expects, got):
    """A key inside a list's entry is named with the list's path and the entry's index, never as `lr` alone, and
    the type it expects is always named."""
    path = tmp_path / "lists.yaml"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load_config(WithLists, path if text else None, [override] if override else [])
    where = f"file {path}" if text else f"command-line override {override!r}"
    assert str(e.value) == f"config key '{key}' in {where} expects {expects}, got {got}"


def test_an_override_sets_one_field_of_one_list_entry():
    """`plan.stages[1].lr=0.5` (or plan.stages.1.lr) changes that entry's field, the rest of the list as it was; an
    unknown field is refused naming the closest, an entry past the list's end says how to add one, and `???`
    makes the field required."""
    cfg = load_config(WithLists, None, ["plan.stages[1].lr=0.5", "plan.stages.0.options.k=v", "plan.sizes[0]=7"])
    assert cfg.plan.stages == [Stage("warmup", options={"k": "v"}), Stage("main", lr=0.5)] and cfg.plan.sizes == [7, 2]
    with pytest.raises(
        ConfigError, match=r"unknown config key 'plan.stages\[1\].lrr' .* did you mean 'plan.stages\[1\].lr'"
    ):
        load_config(WithLists, None, ["plan.stages[1].lrr=1"])
    with pytest.raises(
        ConfigError,
        match=r"config key 'plan.stages\[2\]' in command-line override 'plan.stages\[2\].lr=1': no such entry "
        r"\(plan.stages has 2, plan.stages\[0\] to plan.stages\[1\]\); to add one, give the whole list: "
        r"plan.stages=\[...\]",
    ):
        load_config(WithLists, None, ["plan.stages[2].lr=1"])
    with pytest.raises(ConfigError, match=r"missing required config key 'plan.stages\[0\].lr'"):
        load_config(WithLists, None, ["plan.stages[0].lr=???"])
    with pytest.raises(ConfigError, match=r"'plan.stages\[0\].lr' is nan"):
        load_config(WithLists, None, ["plan.stages[0].lr=nan"])


def list_entry_fields(schema: type, prefix: str = "") -> list[tuple[str, type]]:
    """(key, type) of each field of the first entry of each of the schema's lists of sections, at any depth (its
    optional sections' too): ("rewards[0].weight", float)."""
    hints, fields = typing.get_type_hints(schema), []
    for f in dataclasses.fields(schema):
        tp = bare(hints[f.name])
        item = (typing.get_args(tp) or [None])[0]
        if dataclasses.is_dataclass(tp):
            fields += list_entry_fields(tp, f"{prefix}{f.name}.")
        elif typing.get_origin(tp) is list and dataclasses.is_dataclass(item):
            item_hints = typing.get_type_hints(item)
            fields += [(f"{prefix}{f.name}[0].{g.name}", bare(item_hints[g.name])) for g in dataclasses.fields(item)]
    return fields


def bare(tp):
    """`X | None` -> X."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return args[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1 else tp


@pytest.mark.parametrize("app", ["grpo", "sft"])  # PPO's and distillation's configs are GRPO's with sections more
def test_every_field_of_every_list_entry_of_an_app_names_its_path_and_type(tmp_path, app):
    """Each field of a list's entry in an app's config (a reward function's or a reward model's settings), given a
    value of the wrong type on the command line or in a file, is refused in one line naming `rewards[0].<field>`
    and the type it expects (tests/integration/test_cli_fuzz.py gives them through the apps' command line)."""
    from tests.support.app_checks import checks_only

    schema, _ = checks_only(app)
    fields = [(key, tp) for key, tp in list_entry_fields(schema) if (typing.get_origin(tp) or tp) in WRONG]
    assert {key.rsplit(".", 1)[-1] for key, _ in fields} >= {"weight", "args", "model", "max_batch", "scale"}
    for key, tp in fields:
        value, expects = WRONG[typing.get_origin(tp) or tp]
        listed, _, field_name = key.partition("[0].")
        path = tmp_path / "entry.yaml"
        path.write_text(f"{listed}:\n  - {{{field_name}: {value}}}\n")
        for source, where in ((None, f"command-line override '{key}={value}'"), (path, f"file {path}")):
            with pytest.raises(ConfigError) as e:
                load_config(schema, source, [f"{key}={value}"] if source is None else [])
            assert str(e.value).startswith(f"config key '{key}' in {where} expects {expects}, got "), str(e.value)


def test_a_section_given_a_value_names_the_section_and_a_mapping():
    """`trainer=abc`, `env.openenv=abc`: OmegaConf's own error names no key; the line names it, and a mapping."""
    from forge_rl.recipes.grpo_config import GRPOConfig

    for key in ("trainer", "env.openenv", "env.openenv.args", "rewards[1].engine_args"):
        with pytest.raises(ConfigError, match=rf"^config key '{re.escape(key)}' in .* expects a mapping, got 'abc'"):
            load_config(GRPOConfig, REPO / "configs/grpo/tiny.yaml", [f"{key}=abc"])
    with pytest.raises(ConfigError, match=r"^config key 'env.openenv.step_timeout_s' in .* expects float, got 'x'"):
        load_config(GRPOConfig, REPO / "configs/grpo/tiny_openenv.yaml", ["env.openenv.step_timeout_s=x"])


def test_parse_args_exits_with_message(cfg_file, capsys):
    assert parse_args(App, ["--config", str(cfg_file), "trainer.lr=0.5"]).trainer.lr == 0.5
    with pytest.raises(SystemExit) as e:
        parse_args(App, ["--config", str(cfg_file), "trainr.lr=0.5"])
    assert e.value.code == 2
    assert "unknown config key 'trainr'" in capsys.readouterr().err


def test_to_yaml_round_trips(tmp_path, cfg_file):
    cfg = load_config(App, cfg_file)
    (tmp_path / "saved.yaml").write_text(to_yaml(cfg))
    assert load_config(App, tmp_path / "saved.yaml") == cfg


def test_required_marker_in_a_file_overrides_the_default(tmp_path):
    from dataclasses import dataclass as _dc

    @_dc
    class WithDefault:
        model: str = "tiny"

    path = tmp_path / "c.yaml"
    path.write_text("model: ???\n")
    with pytest.raises(ConfigError, match="missing required config key 'model'"):
        load_config(WithDefault, path)
    assert load_config(WithDefault, path, ["model=/data/qwen"]).model == "/data/qwen"


# ---- every shipped config ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", [p for p in SHIPPED if needs_no_integration(p)], ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_every_shipped_config_loads_and_validates(path):
    """Each file under configs/ parses into its app's schema and passes the app's start-up checks (a required
    model path is given here as the user would); those setting verifiers or OpenEnv beside those integrations'
    tests (tests/integration/test_verifiers_env.py, test_openenv_adapter.py), as importing them takes seconds."""
    check_shipped_config(path)


def test_shipped_configs_cover_every_app():
    assert {p.parent.name for p in SHIPPED} == {"grpo", "sft", "distill", "ppo", "tinker"}


def test_max_policy_age_is_one_key():
    """The buffer's staleness bound is the run's max_policy_age: buffer.max_policy_age is not a second key."""
    from forge_rl.recipes.grpo_config import GRPOConfig

    with pytest.raises(ConfigError, match="buffer.max_policy_age"):
        load_config(GRPOConfig, REPO / "configs/grpo/tiny.yaml", ["buffer.max_policy_age=3"])


def test_verbose_flag_is_the_verbose_key_of_apps_that_have_one():
    from forge_rl.recipes.grpo_config import GRPOConfig

    assert parse_args(GRPOConfig, ["--config", "configs/grpo/tiny.yaml", "--verbose"]).verbose is True
    assert parse_args(GRPOConfig, ["--config", "configs/grpo/tiny.yaml"]).verbose is False
    with pytest.raises(SystemExit):  # an app without the key has no such flag
        parse_args(App, ["--verbose"])


def test_a_run_fills_in_its_own_copy_of_the_config(tmp_path):
    """A run derives settings (the trainer's temperature, token_sum's constant, the model's path) in its own copy:
    a second run from the same object (a notebook) derives them again from what the user changed."""
    from forge_rl.recipes.rl_run import RLRun
    from forge_rl.recipes.grpo_config import GRPOConfig

    cfg = load_config(GRPOConfig, REPO / "configs/grpo/tiny.yaml", [f"output_dir={tmp_path}"])
    cfg.trainer.loss.normalize = "token_sum"
    first = RLRun(cfg)
    first.prepare()
    assert first.cfg.trainer.loss.max_response_len > 0 and first.cfg.trainer.temperature is not None
    assert cfg.trainer.loss.max_response_len == 0 and cfg.trainer.temperature is None
    assert first.cfg.trainer.profile_dir == str(tmp_path / "profile")  # trainer.profile_steps' traces: the run's
    cfg.generator.sampling["max_tokens"] *= 2
    second = RLRun(cfg)
    second.prepare()
    assert second.cfg.trainer.loss.max_response_len > first.cfg.trainer.loss.max_response_len


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["reference.follow_every=5"], "reference.follow_every=5 but the run has no reference policy"),
        (
            ["reference.follow_every=5", "trainer.loss.kl_coef=0.1", "reference.follow_lag=2"],
            r"reference.follow_lag=2: the weight store keeps only the newest 2 versions \(weight_store.keep_versions\)",
        ),
        (["reference.follow_every=-1"], "reference.follow_every=-1 must be >= 0"),
    ],
)
def test_a_following_reference_needs_a_reference_and_a_version_the_store_keeps(overrides, message):
    from forge_rl.recipes.grpo_checks import check_config
    from forge_rl.recipes.grpo_config import GRPOConfig

    cfg = load_config(GRPOConfig, REPO / "configs/grpo/tiny.yaml", overrides)
    with pytest.raises(ConfigError, match=message):
        check_config(cfg)


def test_profile_steps_are_steps_of_the_run():
    """trainer.profile_steps: numbered from 1 (the config's own check) and not past `steps` (a window that never
    ends writes no trace)."""
    from forge_rl.recipes.grpo_checks import check_config
    from forge_rl.recipes.grpo_config import GRPOConfig

    tiny = REPO / "configs/grpo/tiny.yaml"
    with pytest.raises(ConfigError, match=r"trainer.profile_steps=\[0, 1\]: steps are numbered from 1"):
        load_config(GRPOConfig, tiny, ["trainer.profile_steps=[0,1]"])
    cfg = load_config(GRPOConfig, tiny, ["trainer.profile_steps=[3,4]", "steps=4"])
    check_config(cfg)
    cfg = load_config(GRPOConfig, tiny, ["trainer.profile_steps=[3,4]", "steps=3"])
    with pytest.raises(ConfigError, match=r"trainer.profile_steps=\[3, 4\] goes past the run's last step \(steps=3\)"):
        check_config(cfg)


# ---- what every run shares: one key each ------------------------------------------------------------


def test_a_renamed_key_is_refused_naming_the_new_one(tmp_path):
    """SFT's older keys for what every run shares (RunConfig) are refused in one line, in a file and on the
    command line alike, naming the key to write instead."""
    from forge_rl.recipes.sft_config import SFTConfig

    old = tmp_path / "old.yaml"
    old.write_text("steps: 3\nsave_every: 2\n")
    with pytest.raises(ConfigError, match=rf"config key 'save_every' in file {old} is now 'checkpoint_every'"):
        load_config(SFTConfig, old)
    with pytest.raises(
        ConfigError, match="config key 'procs' in command-line override 'procs=2' is now 'trainer_procs'"
    ):
        load_config(SFTConfig, None, ["procs=2"])
    cfg = load_config(SFTConfig, None, ["trainer_procs=2", "checkpoint_every=5"])
    assert (cfg.trainer_procs, cfg.checkpoint_every) == (2, 5)


def test_grpo_and_sft_share_the_run_keys():
    """The keys of RunConfig are the same keys, with the same checks, in every recipe's config."""
    import dataclasses

    from forge_rl.recipes.grpo_config import GRPOConfig
    from forge_rl.recipes.ppo_config import PPOConfig
    from forge_rl.recipes.run_config import RunConfig
    from forge_rl.recipes.sft_config import SFTConfig

    shared = {f.name for f in dataclasses.fields(RunConfig)}
    for schema in (GRPOConfig, PPOConfig, SFTConfig):
        assert issubclass(schema, RunConfig) and shared <= {f.name for f in dataclasses.fields(schema)}
        with pytest.raises(ConfigError, match="checkpoint_every must be >= 0"):
            load_config(schema, None, ["checkpoint_every=-1"])
        with pytest.raises(ConfigError, match="resume='sometimes': use true, false or auto"):
            load_config(schema, None, ["resume=sometimes"])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["trainer_procs=3", "trainer.parallel.tp=2"], r"trainer_procs=3 is not a multiple of trainer.parallel.tp=2"),
        (["trainer_procs=4", "trainer.parallel.dp_shard=3"], r"dp_shard=3 x tp=1 does not fit trainer_procs=4"),
    ],
)
def test_one_data_parallel_size_for_every_run(overrides, message):
    """dp_size reads trainer_procs and trainer.parallel the same way for GRPO and SFT; each run's batch must divide
    by it."""
    from forge_rl.recipes.grpo_config import GRPOConfig
    from forge_rl.recipes.run_config import dp_size
    from forge_rl.recipes.sft_config import SFTConfig

    for schema, batch_key in ((GRPOConfig, "batch_groups"), (SFTConfig, "batch_size")):
        with pytest.raises(ConfigError, match=message):
            dp_size(load_config(schema, None, overrides), batch_key)
    assert dp_size(load_config(GRPOConfig, None, ["trainer_procs=4", "trainer.parallel.tp=2"]), "batch_groups") == 2
    with pytest.raises(ConfigError, match="batch_size=30 must be a multiple of the data-parallel size 4"):
        dp_size(load_config(SFTConfig, None, ["trainer_procs=4", "batch_size=30"]), "batch_size")


def test_checking_a_config_leaves_it_as_it_was():
    """check_config only checks; derive_settings fills in what follows from the other settings."""
    import copy

    from forge_rl.recipes.grpo_checks import check_config, derive_settings
    from forge_rl.recipes.grpo_config import GRPOConfig

    cfg = load_config(
        GRPOConfig,
        REPO / "configs/grpo/tiny.yaml",
        ["generator.sampling.temperature=0.7", "trainer.loss.normalize=token_sum"],
    )
    before = copy.deepcopy(cfg)
    check_config(cfg)
    assert cfg == before
    derive_settings(cfg)
    assert cfg.trainer.temperature == 0.7 and cfg.trainer.loss.max_response_len == cfg.generator.sampling["max_tokens"]


@pytest.mark.parametrize(
    "config, override, line",
    [
        (
            "tiny.yaml",
            "env.args.tools=0",
            "env.args.tools=0: give a list of tool names, e.g. [calculator]; available: ['calculator', 'python']",
        ),
        (
            "tiny.yaml",
            "env.args.tools[0]=[]",
            "env.args.tools[0]=[]: give a tool's name; available: ['calculator', 'python']",
        ),
        (
            "tiny_openenv.yaml",
            "env.openenv.action=''",
            "env.openenv.action='': write it 'package.module:Class' (the Action class), or leave it out for the "
            "Action that env.openenv.env's step annotates",
        ),
        (
            "tiny_rm.yaml",
            "rewards[0].kind=abc",
            "rewards[0].kind='abc': the reward model 'tiny-rm' has no such kind; choose one of ('classifier', 'judge')",
        ),
        (
            "tiny_rm.yaml",
            "rewards[1].name=abc",
            "rewards[1].name: reward 'abc': not one of ['code_tests', 'exact_match', 'format', 'math', "
            "'math_format'] and not 'package.module:function'",
        ),
    ],
)
def test_what_the_long_fuzz_found_in_tools_openenv_and_rewards_is_one_line_naming_the_key(
    monkeypatch, tmp_path, config, override, line
):
    """The GRPO app up to its first actor (tests/support/app_checks.py): exit status 2 and one line naming the key's
    whole path, before any engine starts."""
    from tests.support.app_checks import check_in_process

    monkeypatch.delenv("FORGE_RL_DEBUG", raising=False)
    monkeypatch.setattr("forge_rl.recipes.command_line.handle_stop_signals", lambda: None)
    monkeypatch.chdir(REPO)
    tools = ["env.name=tools", "env.args={tools: [calculator]}"] if config == "tiny.yaml" else []
    argv = ["--config", f"configs/grpo/{config}", *tools, override, f"output_dir={tmp_path}"]
    checked = check_in_process("grpo", argv)
    assert checked.status == 2 and checked.stderr.strip() == f"forge_rl: {line}", checked.stderr
