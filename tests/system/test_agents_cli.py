"""The released coding-agent CLIs, unmodified, against the server: Claude Code (`claude -p`, the
Messages API), Codex (`codex exec`, the Responses API) and opencode (`opencode run`, chat
completions), each with its default tools.

Each runs one turn in which the "model" calls the agent's shell tool, the agent runs the
command and sends its output back, and the model answers with what it printed. The model is
the fake actor with a script (`FakeActor(reply=...)`) over a tiny tool-calling tokenizer and a
128k context: the agents' prompts are 30-40k tokens of system text and tool definitions,
which a random model on the CPU would take minutes to prefill and would never answer with a
call. Everything else is real: the server, the engine's chat template, tool parsing and
streaming, and the agents themselves, pinned in tests/agents/package.json and installed by
scripts/test.sh (`npm ci`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import types
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio
from app_server import engine_factory, serve

from trio_mlx.actor import FakeActor
from trio_mlx.models import load_tokenizer

BIN = Path(__file__).parents[1] / "agents" / "node_modules" / ".bin"
ASK = "Run the check command"
# The command prints this only when a shell runs it: seen in a prompt, it is the tool's result.
COMMAND = "echo trio-mlx-$((6*7))"
PRINTED = "trio-mlx-42"
CONTEXT = 131072

pytestmark = pytest.mark.timeout(300)


def agent(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{path} is missing: scripts/test.sh installs the agent CLIs (npm ci in tests/agents)")
    return str(path)


def script(model: Path, call: Callable[[str], str]) -> Callable[[tuple[int, ...]], Sequence[int]]:
    """The fake model's answers: the tool call `call(COMMAND)` to a request whose prompt asks for
    the check, the command's output once its result is in the prompt, "OK" to anything else
    (the agents' side requests: titles, summaries)."""
    tok = load_tokenizer(model)
    eos = tok.eos_token_id

    def reply(prompt: tuple[int, ...]) -> list[int]:
        text = tok.decode(list(prompt))
        if PRINTED in text:
            answer = f"The check printed {PRINTED}."
        elif ASK in text:
            answer = call(COMMAND)
        else:
            answer = "OK"
        return [*tok.encode(answer, add_special_tokens=False), eos]

    return reply


def tool_call(name: str, arguments: dict[str, Any]) -> str:
    """A call in the test tokenizer's template format (Hermes' `<tool_call>` JSON)."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def record_statuses(server: Any) -> list[tuple[str, int | None]]:
    """(path, status) of every generation request the server answers from now on."""
    seen: list[tuple[str, int | None]] = []
    observe = server.app.observe

    def spy(rec: Any) -> None:
        seen.append((rec.endpoint, rec.status))
        observe(rec)

    server.app.observe = spy
    return seen


@asynccontextmanager
async def agent_server(model: Path, call: Callable[[str], str], **settings: Any) -> AsyncIterator[tuple[Any, list[Any]]]:
    """A server of the scripted model whose tool call is `call(COMMAND)`, and the (path, status)
    of every generation request it answers."""
    actor = partial(FakeActor, reply=script(model, call), context_length=CONTEXT)
    async with serve(model, factory=engine_factory(actor=actor), model_name="local", **settings) as server:
        yield server, record_statuses(server)


def finished(code: int, out: str, err: str, statuses: list[Any]) -> list[dict[str, Any]]:
    """The agent's JSON events, once it exited 0 and every request it made was served (none
    refused: each agent's first request used to be)."""
    assert code == 0, (out[-3000:], err[-3000:])
    assert statuses and all(status == 200 for _, status in statuses), statuses
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


async def run_agent(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str, str]:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CODEX_"))}
    full_env.update(env, NO_COLOR="1", DISABLE_AUTOUPDATER="1", DISABLE_TELEMETRY="1",
                    DISABLE_ERROR_REPORTING="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1")
    # opencode's Bun binary unpacks a 5 MB native module into $TMPDIR on every run and never
    # removes it: a private TMPDIR, removed here, keeps the suite from filling the machine's /tmp.
    with tempfile.TemporaryDirectory(prefix="agent-tmp-") as tmp:
        full_env["TMPDIR"] = tmp
        proc = await trio.run_process(argv, env=full_env, cwd=str(cwd), capture_stdout=True,
                                      capture_stderr=True, check=False, stdin=b"")
    return proc.returncode, proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace")


async def test_claude_code_runs_a_tool_and_answers(tool_model_fp32, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    def bash(cmd: str) -> str:
        return tool_call("Bash", {"command": cmd, "description": "the check"})

    # No model named: Claude Code asks for its own `claude-...` models, which an alias serves.
    async with agent_server(tool_model_fp32, bash, model_aliases=("claude-*=local",)) as (server, statuses):
        ran = await run_agent(
            [agent("claude"), "-p", ASK, "--output-format", "stream-json", "--verbose", "--allowedTools", "Bash"],
            {"ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": "local", "HOME": str(home)}, tmp_path)
    # Its first request holds a system turn inside messages, under a beta.
    events = finished(*ran, statuses)
    uses = [b for e in events if e.get("type") == "assistant" for b in e["message"]["content"]
            if b.get("type") == "tool_use"]
    assert [u["name"] for u in uses] == ["Bash"] and uses[0]["input"]["command"] == COMMAND
    results = [b for e in events if e.get("type") == "user" for b in e["message"]["content"]
               if isinstance(b, dict) and b.get("type") == "tool_result"]
    assert results and PRINTED in json.dumps(results[0]["content"]) and not results[0].get("is_error")
    final = events[-1]
    assert final["type"] == "result" and not final["is_error"] and PRINTED in final["result"]


async def test_codex_runs_a_tool_and_answers(tool_model_fp32, tmp_path):
    home = tmp_path / "codex-home"
    home.mkdir()
    work = tmp_path / "work"
    work.mkdir()
    async with agent_server(tool_model_fp32, lambda cmd: tool_call("exec_command", {"cmd": cmd})) as (server, statuses):
        (home / "config.toml").write_text(
            'model = "local"\nmodel_provider = "trio_mlx"\n\n[model_providers.trio_mlx]\nname = "trio-mlx"\n'
            f'base_url = "{server.url}/v1"\nwire_api = "responses"\nenv_key = "TRIO_MLX_KEY"\n')
        ran = await run_agent(
            [agent("codex"), "exec", "--json", "--skip-git-repo-check",
             "--dangerously-bypass-approvals-and-sandbox", ASK],
            {"CODEX_HOME": str(home), "TRIO_MLX_KEY": "local", "HOME": str(home)}, work)
    # Its first request holds a namespace of tools and the hosted web_search.
    events = finished(*ran, statuses)
    commands = [e["item"] for e in events if e.get("type") == "item.completed"
                and e["item"].get("type") == "command_execution"]
    assert commands and COMMAND in commands[0]["command"] and PRINTED in commands[0]["aggregated_output"]
    messages = [e["item"]["text"] for e in events if e.get("type") == "item.completed"
                and e["item"].get("type") == "agent_message"]
    assert messages and PRINTED in messages[-1]


def test_the_agent_clis_are_pinned():
    """The versions the suite runs are the ones tests/agents/package.json pins."""
    pins = json.loads((BIN.parent.parent / "package.json").read_text())["dependencies"]
    for package, version in pins.items():
        installed = json.loads((BIN.parent / package / "package.json").read_text())["version"]
        assert installed == version
    assert shutil.which("node")


async def test_opencode_runs_a_tool_and_answers(tool_model_fp32, tmp_path):
    """opencode, through the chat completions endpoint (its `@ai-sdk/openai-compatible` provider)."""
    home = tmp_path / "home"
    config = home / ".config" / "opencode"
    config.mkdir(parents=True)
    work = tmp_path / "work"
    work.mkdir()
    def bash(cmd: str) -> str:
        return tool_call("bash", {"command": cmd, "description": "the check"})

    async with agent_server(tool_model_fp32, bash) as (server, statuses):
        (config / "opencode.json").write_text(json.dumps({
            "$schema": "https://opencode.ai/config.json",
            "provider": {"trio-mlx": {"npm": "@ai-sdk/openai-compatible", "name": "trio-mlx",
                                      "options": {"baseURL": f"{server.url}/v1", "apiKey": "local"},
                                      "models": {"local": {"name": "local", "tool_call": True,
                                                           "limit": {"context": CONTEXT, "output": 4096}}}}},
            "model": "trio-mlx/local", "permission": {"bash": "allow"}, "autoupdate": False, "share": "disabled"}))
        ran = await run_agent(
            [agent("opencode"), "run", "--format", "json", "-m", "trio-mlx/local", ASK],
            {"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".data"),
             "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".state")}, work)
    events = finished(*ran, statuses)
    tools = [e["part"] for e in events if e.get("type") == "tool_use"]
    assert tools and tools[0]["tool"] == "bash" and PRINTED in json.dumps(tools[0]["state"].get("output"))
    assert PRINTED in "".join(e["part"].get("text", "") for e in events if e.get("type") == "text")


async def test_claude_code_turns_on_two_models_of_one_server_each_by_its_alias(tool_model_fp32, tmp_path):
    """One server of several models (`--models`) with Claude Code's model names aliased to two
    local models, as a user maps its main and small-fast models: a turn on a Sonnet name runs
    the tool on the large model, a turn on a Haiku name on the small one, both loaded side by
    side (`--max-loaded-models 2`), every request a 200."""
    from unit.test_app_models import serve_models

    home = tmp_path / "home"
    home.mkdir()
    folder = tmp_path / "models"
    for name in ("large", "small"):
        shutil.copytree(tool_model_fp32, folder / name)
    reply = script(tool_model_fp32, lambda cmd: tool_call("Bash", {"command": cmd, "description": "the check"}))
    asked: list[str] = []  # the model of every generation, in order

    def make(config: Any, link: Any) -> FakeActor:
        def answer(prompt: tuple[int, ...]) -> Sequence[int]:
            asked.append(config.model_path.name)
            return reply(prompt)
        return FakeActor(config, link, reply=answer, context_length=CONTEXT)

    aliases = ("claude-*haiku*=small", "claude-*=large")
    env = {"ANTHROPIC_API_KEY": "local", "HOME": str(home),
           "ANTHROPIC_SMALL_FAST_MODEL": "claude-3-5-haiku-20241022"}
    async with serve_models(folder, actor=make, max_loaded_models=2, model_aliases=aliases) as (app, client):
        env["ANTHROPIC_BASE_URL"] = str(client.base_url).rstrip("/")
        statuses = record_statuses(types.SimpleNamespace(app=app))
        by_turn = []
        for model in ("claude-sonnet-4-5", "claude-3-5-haiku-20241022"):
            del asked[:]
            ran = await run_agent([agent("claude"), "-p", ASK, "--output-format", "stream-json", "--verbose",
                                   "--allowedTools", "Bash", "--model", model], env, tmp_path)
            final = finished(*ran, statuses)[-1]
            assert final["type"] == "result" and not final["is_error"] and PRINTED in final["result"], final
            by_turn.append(set(asked))
        loaded = {s.name: s.state for s in app.pool.status()}
    assert by_turn[0] >= {"large"} and by_turn[1] >= {"small"}, by_turn
    assert loaded == {"large": "loaded", "small": "loaded"}
