"""A role's process lost while its actor starts (killed during start-up, or silent past Monarch's spawn timeout) is
a stop naming the role, as one lost later is; an error raised by the actor's own code stays what it is. Monarch's
errors here are built from the messages it gives (a run's own: benchmarks/chaos.py kills roles in start-up)."""

from monarch.actor import ActorError

from forge_rl.deps.monarch import SupervisionError
from forge_rl.errors import stated_error
from forge_rl.loop.train_loop import RoleDied, role_died
from forge_rl.runtime.faults import RoleStartFailed, process_lost

SETUP_KILLED = SupervisionError(
    "Actor <root>.<monarch._src.actor.proc_mesh.SetupActor setup{'procs': 0/1}> failed:\n"
    "  the process this actor was running on failed: Killed(sig=9)"
)
SPAWN_TIMEOUT = RuntimeError("error spawning actor mesh: statuses: Timeout(30.001930838s)=0..1 Stack backtrace: ...")


def test_a_process_lost_while_starting_is_told_from_an_error_of_the_actors_code():
    assert process_lost(SETUP_KILLED) == "Killed(sig=9)"
    assert process_lost(SPAWN_TIMEOUT) == "no answer to its spawn in 30 s"
    assert process_lost(ActorError(ValueError("bad setting"))) is None  # raised by setup(): a bug or a user error
    assert process_lost(RuntimeError("something else")) is None


def test_the_run_names_the_role_lost_while_starting_and_where_to_resume(tmp_path):
    died = role_died(RoleStartFailed("PromptDataset", "no answer to its spawn in 30 s"), tmp_path, tmp_path / "logs")
    assert isinstance(died, RoleDied) and stated_error(died) is died
    assert str(died).startswith(
        f"the PromptDataset process died while it started (no answer to its spawn in 30 s); its output is in "
        f"{tmp_path / 'logs'}/; "
    )
    unnamed = role_died(SETUP_KILLED, tmp_path)  # Monarch's own setup actor: no role to name, and no "the an actor"
    assert str(unnamed).startswith("a role's process died (Killed(sig=9)); ")
    trainer = SupervisionError(
        "Actor <root>.<forge_rl.actors.trainer.Trainer Trainer{'procs': 0/1}> failed:\n"
        "  the process this actor was running on failed: Killed(sig=9)"
    )
    assert str(role_died(trainer, tmp_path)).startswith("the Trainer process died (Killed(sig=9)); ")


def test_a_role_whose_process_stopped_answering_is_named_as_the_run_named_it(tmp_path):
    """When the proc's agent stops answering before its death is seen, Monarch names only the actor mesh, lower-cased
    and suffixed: the run's own role names give it back its name."""
    silent = SupervisionError(
        'timeout waiting for message from proc mesh agent while querying for "trainer-tnyrC3vdtwQ". '
        "The process likely crashed"
    )
    assert process_lost(silent) == "its process stopped answering; it likely crashed"  # while it started
    died = str(role_died(silent, tmp_path, roles={"Generator-r0g0", "Trainer", "ReplayBuffer"}))
    assert died.startswith("the Trainer process died (its process stopped answering; it likely crashed); ")
    assert str(role_died(silent, tmp_path)).startswith("the trainer process died (")  # no names given: Monarch's
