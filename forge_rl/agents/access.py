"""Who may call the run's OpenAI-compatible endpoint (forge_rl/agents/server.py): bearer keys made by `secrets`.

Each episode has a key of its own, which its client is given (the openai client's api_key; OPENAI_API_KEY for a
program) and which names the episode (`forge-rl-episode-<id>-...`): an episode's URL takes only that key, so no
other process on the host, and no other episode, can sample from the policy there or put calls into the episode
being trained. The root URL takes the run's key, which stays in the run's process; a root-URL call that names its
episode in the model (a client with one connection pool for many episodes, verifiers' interception server) takes
that episode's key or the run's. A call without the key it takes is refused (401) before anything of it is read
into an episode: never recorded, never trained on, and the episode goes on.
"""

import hmac
import secrets


class Unauthorised(PermissionError):
    """A call without the key its URL (or the episode its model names) takes: answered 401."""


def run_key() -> str:
    return f"forge-rl-run-{secrets.token_urlsafe(32)}"


def episode_key(episode_id: str) -> str:
    return f"forge-rl-episode-{episode_id}-{secrets.token_urlsafe(32)}"


def bearer(authorization: str | None) -> str:
    """The key of an `Authorization: Bearer <key>` header ("" when there is none)."""
    scheme, _, key = (authorization or "").partition(" ")
    return key.strip() if scheme.lower() == "bearer" else ""


def admitted(authorization: str | None, keys: list[str]) -> bool:
    """Whether the header carries one of `keys` (compared in constant time: a key is not found out from how long
    a wrong one takes to refuse)."""
    given = bearer(authorization).encode()
    return bool(given) and any(hmac.compare_digest(given, k.encode()) for k in keys if k)


def refusal(episode_id: str | None) -> Unauthorised:
    """The 401 of a call to `episode_id` (None: the root URL) without its key, saying which key it takes."""
    if episode_id is None:
        return Unauthorised(
            "missing or wrong API key: the root URL takes the run's key; an agent calls its episode's base URL "
            "with its episode's key (its client's api_key, OPENAI_API_KEY)"
        )
    return Unauthorised(
        f"missing or wrong API key for episode {episode_id}: its calls carry the key its client was given "
        "(client.api_key, OPENAI_API_KEY), which no other episode's calls can use"
    )
