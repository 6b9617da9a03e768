"""The `switchyard` command modules: each command's parser leads to its module's `run`."""

import argparse
from types import ModuleType

import pytest

from cli.commands import bench, cascade, models
from cli.main import COMMANDS, build_parser


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return action


def test_every_command_module_is_a_subcommand_that_runs_its_own_run() -> None:
    choices = _subparsers(build_parser()).choices
    assert len(choices) == len(COMMANDS)
    for module in COMMANDS:
        (name,) = [n for n, p in choices.items() if p.get_default("run") is module.run]
        assert module.__name__ == "cli.commands." + name


@pytest.mark.parametrize(
    ("module", "dest"), [(models, "action"), (cascade, "action"), (bench, "target")]
)
def test_every_action_of_a_command_has_a_handler_and_no_handler_lacks_an_action(
    module: ModuleType, dest: str
) -> None:
    parser = argparse.ArgumentParser()
    module.add_parser(parser.add_subparsers(dest="command"))
    (command,) = _subparsers(parser).choices.values()
    actions = _subparsers(command)
    assert actions.dest == dest
    assert list(actions.choices) == list(module.ACTIONS)


def test_run_dispatches_on_the_action_given(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    monkeypatch.setitem(bench.ACTIONS, "upstream", lambda args: seen.append(args.out) or 7)
    args = build_parser().parse_args(["bench", "upstream", "--out", "somewhere"])
    assert args.run(args) == 7
    assert seen == ["somewhere"]
