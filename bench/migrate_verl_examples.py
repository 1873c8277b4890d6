"""`hybridflow migrate` over every ``examples/**/*.sh`` of a verl checkout: how many give a recipe that
`hybridflow config` accepts, and why the rest do not.

    pip install --target /tmp/verl_site --no-deps tensordict pyvers mathruler pylatexenc wandb    # what verl's imports and its loggers need
    python bench/migrate_verl_examples.py /path/to/verl --site /tmp/verl_site [--out bench/results/migrate_verl_examples.json]

Each script is migrated as a user would (`hybridflow migrate SCRIPT --out R.yaml`, run with the checkout as
the working directory, where verl's scripts expect to run), then checked with `hybridflow config --config
R.yaml` plus stand-ins for what names the hub or a user's disk: the scripts name hub models (``Qwen/...``) and
``$HOME/data/...`` parquet files, so every model key the recipe sets (``model.path``, ``critic.model.path``,
``reward.reward_model.path``, ``model.tokenizer_path``) is replaced by one tiny local model and
``data.train_files`` / ``data.val_files`` by one tiny verl-format parquet file (``model.path`` and
``data.train_files`` always: a script whose path holds a variable nothing sets, such as ``$pwd``, leaves them to the
command line). An SFT script's recipe is checked with ``hybridflow config --command sft``. Everything else (tool and
interaction configs, reward files, every other key) is checked as migrated, so verl's tool, interaction and reward
modules are imported: `--site` names a folder holding what they import beyond this environment (verl's own
dependencies tensordict, pyvers, mathruler, pylatexenc) and wandb, which most scripts log to, as a verl user's
environment holds them. The checkout needs its ``recipe`` submodule (``git submodule update --init recipe``):
some examples name its reward files and tool configs. A script counts as accepted when
both commands exit 0. Prints a table by example folder and the reasons of the rest; writes the JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from hybridflow import cli
from hybridflow.config.migrate import read_verl

STAND_IN_ROWS = 4096
STAND_IN_KEYS = ("model.path", "model.tokenizer_path", "critic.model.path", "reward.reward_model.path")


def _stand_ins(root: Path) -> tuple[Path, Path]:
    """A tiny model and a folder of two verl-format parquet files, as many rows each as the largest batch the examples
    ask for (`data.train_batch_size=4096`: `hybridflow config` reads every row and refuses data with fewer rows
    than a batch, as `train` does): `train.parquet`, short gsm8k-shaped rows (with the nested fields verl's gsm8k
    SFT scripts read), and `chats.parquet`, a conversation a row (verl's multi-turn SFT scripts')."""
    import pandas as pd

    from hybridflow.utils.tiny_model import build_tiny_model

    model = build_tiny_model(root / "model")
    rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
             "extra_info": {"index": i, "question": f"What is {i} + {i}?", "answer": f"#### {2 * i}",
                            "interaction_kwargs": {"name": "gsm8k", "query": "q", "ground_truth": str(2 * i)}}}
            for i in range(STAND_IN_ROWS)]
    pd.DataFrame(rows).to_parquet(root / "train.parquet")
    chats = [{"messages": [{"role": "user", "content": f"What is {i} + {i}?"},
                           {"role": "assistant", "content": f"#### {2 * i}"}]} for i in range(STAND_IN_ROWS)]
    pd.DataFrame(chats).to_parquet(root / "chats.parquet")
    return model, root


def _run(argv: list[str]) -> tuple[int, str]:
    """`hybridflow ARGV` in this process: its exit status and what it printed to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = cli.main(argv)
        except Exception as e:  # a crash is a result too: counted with its type
            code, err = 1, io.StringIO(f"crash: {type(e).__name__}: {e}")
    return code, err.getvalue().strip()


def check(script: Path, work: Path, model: Path, data: Path) -> dict[str, object]:
    """One script: migrate, then config with the stand-ins (`data`: their folder); the outcome and its reason."""
    recipe = work / (script.stem + ".yaml")
    code, err = _run(["migrate", str(script), "--out", str(recipe)])
    warnings = [line for line in err.splitlines() if ": warning: " in line]
    if code != 0:
        reason = err.splitlines()[-1].replace(f"hybridflow migrate: {script}: ", "") if err else f"exit {code}"
        return {"accepted": False, "stage": "migrate", "problems": [reason]}
    text = recipe.read_text()
    # each verl key is named in the recipe: after a key it set ("# key" or "# other, key"), or listed ("#   key=")
    unaccounted = [key for key in read_verl(script).settings
                   if not re.search(rf"(# |, |#   ){re.escape(key)}(=|,|$)", text, re.M)]
    carried = [line.split(":")[0].strip() for line in text.splitlines() if "  # " in line and not line.startswith("#")]
    not_carried = sum(1 for line in text.splitlines() if line.startswith("#   "))
    overrides = [f"{key}={model}" for key in STAND_IN_KEYS if key == "model.path" or _sets(text, key)]
    data = data / ("chats.parquet" if _sets(text, "data.messages_key") else "train.parquet")
    overrides += [f"data.train_files=[{data}]"] + ([f"data.val_files=[{data}]"] if _sets(text, "data.val_files") else [])
    command = "sft" if "a recipe for `hybridflow sft`" in text.splitlines()[0] else "train"
    code, err = _run(["config", "--command", command, "--config", str(recipe), *overrides])
    out: dict[str, object] = {"accepted": code == 0, "stage": "config", "keys_written": len(carried),
                              "keys_not_carried": not_carried, "unaccounted_keys": unaccounted, "warnings": warnings}
    if code != 0:  # one problem a line ("  - ..."), or the one line after "invalid configuration:"
        out["problems"] = [line.strip().removeprefix("- ") for line in err.splitlines()[1:]] or [err]
    return out


def _sets(text: str, key: str) -> bool:
    """Whether the recipe sets dotted `key` (reloaded, so the check does not depend on the layout)."""
    import yaml

    node = yaml.safe_load(text) or {}
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return node is not None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("verl", type=Path, help="a verl checkout (its examples/ folder is read)")
    parser.add_argument("--site", type=Path, help="a folder of packages verl's modules and loggers import "
                        "(pip install --target DIR --no-deps tensordict pyvers mathruler pylatexenc wandb); appended to the path")
    parser.add_argument("--out", type=Path, default=Path("bench/results/migrate_verl_examples.json"),
                        help="the JSON to write: per script, accepted or not, keys written and not carried, "
                        "warnings, problems")
    args = parser.parse_args()
    verl = args.verl.resolve()
    scripts = sorted((verl / "examples").rglob("*.sh"))
    if not scripts:
        sys.exit(f"no examples/**/*.sh under {verl}")
    commit = subprocess.run(["git", "-C", str(verl), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    out_path = args.out.resolve()
    results: dict[str, dict[str, object]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, data = _stand_ins(work)
        os.chdir(verl)  # verl's scripts are run from the checkout's root
        extra = [str(verl)] + ([str(args.site.resolve())] if args.site else [])
        sys.path[:0] = extra[:1]  # its tool and interaction classes are named verl.tools.X
        sys.path += extra[1:]  # after this environment's own packages, which it must not shadow
        os.environ["PYTHONPATH"] = os.pathsep.join([str(verl), os.environ.get("PYTHONPATH", ""), *extra[1:]])
        for script in scripts:
            name = str(script.relative_to(verl))
            results[name] = check(script, work, model, data)
            print(f"{'ok  ' if results[name]['accepted'] else 'FAIL'} {name}", flush=True)
    accepted = sum(r["accepted"] is True for r in results.values())
    folders: dict[str, list[int]] = {}
    for name, r in results.items():
        folder = name.split("/")[1]
        folders.setdefault(folder, [0, 0])[0] += r["accepted"] is True
        folders[folder][1] += 1
    unaccounted = sum(len(r.get("unaccounted_keys", ())) for r in results.values())  # type: ignore[arg-type]
    print(f"\nverl {commit[:9] or '(not a git checkout)'}: {accepted} of {len(results)} scripts give a recipe "
          f"`hybridflow config` accepts; verl keys neither carried nor listed with a reason: {unaccounted}"
          f"\n\n| examples/ folder | accepted | scripts |\n|---|---|---|")
    for folder, (ok, total) in sorted(folders.items()):
        print(f"| {folder} | {ok} | {total} |")
    reasons = Counter(problem for r in results.values() if not r["accepted"] for problem in r["problems"])
    print("\n| why a script's recipe is refused (a script may have several) | scripts |\n|---|---|")
    for reason, count in reasons.most_common():
        print(f"| {reason} | {count} |")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"verl_commit": commit, "scripts": len(results), "accepted": accepted,
                                    "results": results}, indent=1) + "\n")
    print(f"\nwrote {out_path}")


if __name__ == "__main__":
    main()
