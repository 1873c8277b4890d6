"""The shell a verl launch script uses for its arguments, worked out without running anything (issue 55):
variables, exports, defaults, arithmetic, arrays, path substitutions, quoting, continuations, ifs; what cannot be
worked out is named, never run."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from hybridflow.config.shell_eval import evaluate
from hybridflow.config.shell_lexer import ShellSyntaxError

SCRIPT = Path("/project/examples/grpo/run.sh")
WORKDIR = Path("/project")


def run(text: str, env: dict[str, str] | None = None):
    return evaluate(textwrap.dedent(text), SCRIPT, WORKDIR, env or {})


def words(text: str, env: dict[str, str] | None = None) -> list[str]:
    """The words of the script's python command."""
    return next([w.text for w in c] for _, c in run(text, env).commands if c[0].text == "python3")


def test_variables_defaults_and_arithmetic():
    assert words("""
        export N=${N:-4}
        BATCH=${BATCH:-$((N * 8))}
        EMPTY=
        LR=${LR-1e-6}
        python3 -m verl.trainer.main_ppo a=$N b=${BATCH} c=$((BATCH / 3 + 2 ** 2)) d=${EMPTY:-x} e=${LR} \\
            f=${UNSET:+no}g ${#BATCH}
    """, {"BATCH": "64"}) == ["python3", "-m", "verl.trainer.main_ppo", "a=4", "b=64", "c=25", "d=x", "e=1e-6", "f=g",
                              "2"]


def test_path_substitutions_are_computed_and_others_are_named_not_run(tmp_path):
    script = run("""
        PROJECT_DIR="$(pwd)"
        HERE=$(cd -- "$(dirname "${BASH_SOURCE[0]}")" >/dev/null 2>&1 && pwd)
        ROOT=$(cd "$HERE/../.." && pwd)
        NAME=$(basename "$0" .sh)
        STAMP=$(date +%s)
        python3 -m verl.trainer.main_ppo p=$PROJECT_DIR/x h=$HERE r=$ROOT n=$NAME s=$STAMP w=$PWD
    """)
    assert [w.text for w in script.commands[-1][1][3:]] == [
        "p=/project/x", "h=/project/examples/grpo", "r=/project", "n=run", "s=$(date +%s)", "w=/project"]
    assert script.notes == ["$(date +%s): a command hybridflow migrate does not run; left as written"]


def test_arrays_quoting_and_continuations():
    assert words("""
        common=(
            a.b=1
            "c.d='x y'"   # a comment
        )
        common+=(e.f=[1,2])
        echo "${#common[@]}" ${common[0]}
        python3 -m verl.trainer.main_ppo \\
            "${common[@]}" \\
            'g.h=$NOT_EXPANDED' i.j="two words" k.l=\\$ESCAPED ${common[2]} 2>&1 | tee log.txt
    """) == ["python3", "-m", "verl.trainer.main_ppo", "a.b=1", "c.d='x y'", "e.f=[1,2]", "g.h=$NOT_EXPANDED",
             "i.j=two words", "k.l=$ESCAPED", "e.f=[1,2]"]


def test_ifs_are_decided_and_a_usage_exit_is_read_past():
    script = run("""
        set -xeuo pipefail
        if [ "$#" -lt 2 ]; then
            echo "Usage: run.sh <gpus> <dir>"
            exit 1
        fi
        engine=${ENGINE:-vllm}
        if [[ $engine == "sglang" ]]; then
            MODE=async
        elif [ "$engine" = "vllm" ] && true; then
            MODE=sync
        else
            MODE=other
        fi
        if [[ -n "$engine" && $engine != "hf" ]]; then GPU=yes; else GPU=no; fi
        if command -v nvidia-smi; then NODE=gpu; fi
        for i in 1 2 3; do
            MODE=loop
        done
        now() { date; }
        python3 -m verl.trainer.main_ppo mode=$MODE gpu=$GPU node=$NODE first=$1
    """)
    assert [w.text for w in script.commands[-1][1][3:]] == ["mode=sync", "gpu=yes", "node=gpu", "first=$1"]
    assert script.notes == ["line 16: `if command -v nvidia-smi` cannot be decided here; read as true"]


def test_secret_variables_are_tracked_in_the_words_they_reach():
    script = run("""
        export WANDB_API_KEY=abc
        KEY_COPY=$WANDB_API_KEY
        python3 -m verl.trainer.main_ppo a.token=$KEY_COPY b=$HF_TOKEN c=1
    """, {"HF_TOKEN": "hf_x"})
    *_, a, b, c = script.commands[-1][1]
    assert a.text == "a.token=abc" and b.secrets == {"HF_TOKEN"} and not c.secrets
    assert script.exported == ["WANDB_API_KEY"]


@pytest.mark.parametrize("text, line, what", [("A='open\npython3 -m x\n", 1, "'"),
                                             ('echo ok\nB="abc\n', 2, '"'),
                                             ("echo ok\nC=$(pwd\n", 2, "(")])
def test_unbalanced_quotes_name_their_line(text, line, what):
    with pytest.raises(ShellSyntaxError, match=f"line {line}: unbalanced \\{what}"):
        run(text)
