"""``clawray gate`` refuses what it cannot do before it connects anywhere."""

import pytest

from clawray.apps.cli import main


@pytest.mark.parametrize("action", ["rollback", "pin"])
def test_rollback_and_pin_need_a_version(action, capsys):
    assert main(["gate", action, "--address", "127.0.0.1:1"]) == 2
    assert f"`clawray gate {action}` needs a version" in capsys.readouterr().err


def test_unknown_actions_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["gate", "merge"])
    assert "invalid choice: 'merge'" in capsys.readouterr().err
