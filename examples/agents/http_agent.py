"""An agent as a program of its own, with no client library: only the standard library's HTTP. It plays the retry
agent's game (examples/agents/retry_agent.py): answer, and after a wrong answer hear "Wrong. Try again." and answer
once more. forge_rl trains it with

    python -m apps.grpo.main --config configs/grpo/tiny_agent.yaml agent.entry=null \
        'agent.command=[python3, examples/agents/http_agent.py]'

which runs it once per episode (docs/agents.md, "Any program as an agent"): OPENAI_BASE_URL and OPENAI_API_KEY are
its episode's endpoint and key, the task's row comes as JSON on stdin, and the reward goes on stdout as JSON. What
it says on stderr goes to the run's logs. It runs as well against any OpenAI-compatible server.
"""

import json
import os
import sys
import urllib.request

FEEDBACK = "Wrong. Try again."
CREDIT = (1.0, 0.5)  # a first right answer is worth more than a corrected one; never right: 0


def chat(messages: list[dict]) -> str:
    """The reply's text to `messages`, from the endpoint's /chat/completions."""
    request = urllib.request.Request(
        os.environ["OPENAI_BASE_URL"].rstrip("/") + "/chat/completions",
        data=json.dumps({"model": "tiny-warm", "messages": messages}).encode(),
        headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)["choices"][0]["message"]["content"] or ""


def main() -> None:
    row = json.load(sys.stdin)
    messages = list(row["messages"])
    reward = 0.0
    for credit in CREDIT:
        text = chat(messages)
        print(f"answered {text!r} to {row['id']}", file=sys.stderr)
        if text.strip() == str(row["answer"]).strip():
            reward = credit
            break
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": FEEDBACK}]
    print(json.dumps({"reward": reward}))


if __name__ == "__main__":
    main()
