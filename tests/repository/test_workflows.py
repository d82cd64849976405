"""The CI workflows: actionlint (with shellcheck on every `run:`), the README's commands, the
per-stack concurrency, credentials only from OIDC and secrets, and the affected-stacks step."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO

WORKFLOWS = REPO / ".github" / "workflows"
ACTIONLINT = Path(shutil.which("actionlint") or REPO / ".venv" / "bin" / "actionlint")


def load(name: str) -> dict:
    doc = yaml.safe_load((WORKFLOWS / name).read_text())
    doc["on"] = doc.pop(True)  # YAML 1.1 reads the key `on` as True
    return doc


def actionlint(*paths: Path) -> subprocess.CompletedProcess[str]:
    assert ACTIONLINT.exists(), "actionlint is missing: the `test` extra installs it"
    assert shutil.which("shellcheck"), "shellcheck is missing: scripts/test installs it"
    return subprocess.run(
        [str(ACTIONLINT), "-no-color", "-oneline", *map(str, paths)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )


def test_workflows_pass_actionlint():
    files = sorted(WORKFLOWS.glob("*.yml"))
    assert {f.name for f in files} >= {"preview.yml", "deploy.yml", "stacks.yml"}
    r = actionlint(*files)
    assert r.returncode == 0, r.stdout + r.stderr


def test_actionlint_catches_a_shell_bug_in_a_run_block(tmp_path):
    # The control for the test above: shellcheck runs on `run:` blocks and fails the lint.
    bad = tmp_path / ".github" / "workflows" / "bad.yml"
    bad.parent.mkdir(parents=True)
    bad.write_text(
        "on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n"
        '      - run: echo $UNQUOTED_VAR > "${{ github.event.pull_request.title }}"\n'
    )
    r = actionlint(bad)
    assert r.returncode == 1 and "shellcheck" in r.stdout and "SC2086" in r.stdout, r.stdout


def steps(doc: dict, job: str) -> list[dict]:
    return doc["jobs"][job]["steps"]


@pytest.mark.parametrize(("name", "job"), [("preview.yml", "preview"), ("deploy.yml", "up")])
def test_pulumi_jobs_set_up_with_the_readme_scripts_and_oidc(name, job):
    doc = load(name)
    runs = [s.get("run", "") for s in steps(doc, job)]
    uses = [s.get("uses", "") for s in steps(doc, job)]
    pulumi = uses.index("pulumi/actions@v7")
    setup = next(
        i for i, r in enumerate(runs) if r.startswith(("scripts/main", "scripts/bootstrap"))
    )
    assert setup < pulumi, "the Python set-up (the README's scripts) must come before pulumi"
    assert "aws-actions/configure-aws-credentials@v6" in uses[:pulumi]
    assert "google-github-actions/auth@v3" in uses[:pulumi]
    assert doc["jobs"][job]["permissions"]["id-token"] == "write"
    text = (WORKFLOWS / name).read_text()
    for key in ("aws-access-key-id", "aws-secret-access-key", "credentials_json"):
        assert key not in text, f"{name}: long-lived credentials ({key}); use OIDC"
    assert "PULUMI_ACCESS_TOKEN: ${{ secrets.PULUMI_ACCESS_TOKEN }}" in text


def test_preview_comments_on_the_pull_request_for_each_affected_stack():
    doc = load("preview.yml")
    assert "stacks/**" in doc["on"]["pull_request"]["paths"]
    assert "solver/**" in doc["on"]["pull_request"]["paths"]
    pulumi = next(s for s in steps(doc, "preview") if s.get("uses") == "pulumi/actions@v7")
    assert pulumi["with"]["command"] == "preview" and pulumi["with"]["comment-on-pr"] is True
    assert doc["jobs"]["preview"]["permissions"]["pull-requests"] == "write"
    assert "needs.stacks.outputs.stacks" in doc["jobs"]["preview"]["strategy"]["matrix"]["stack"]


def test_deploy_runs_up_per_stack_in_its_own_concurrency_group_after_the_tests():
    doc = load("deploy.yml")
    assert set(doc["on"]) == {"push", "schedule", "workflow_dispatch"}
    assert doc["on"]["push"]["branches"] == ["main"] and "stacks/**" in doc["on"]["push"]["paths"]
    up = doc["jobs"]["up"]
    assert up["concurrency"] == {"group": "pulumi-${{ matrix.stack }}", "cancel-in-progress": False}
    assert set(up["needs"]) == {"stacks", "test"}
    assert [s["run"] for s in steps(doc, "test") if "run" in s] == ["scripts/test"]
    pulumi = next(s for s in steps(doc, "up") if s.get("uses") == "pulumi/actions@v7")
    assert pulumi["with"]["command"] == "up"
    refresh = next(s["run"] for s in steps(doc, "up") if "demand refresh" in s.get("run", ""))
    assert "--write" in refresh


def affected_script() -> str:
    step = next(s for s in steps(load("stacks.yml"), "affected") if s.get("id") == "affected")
    return step["run"]


@pytest.fixture
def repo(tmp_path):
    """A git repository with the real stacks/ and one code file, committed once."""
    shutil.copytree(REPO / "stacks", tmp_path / "stacks")
    (tmp_path / "solver").mkdir()
    (tmp_path / "solver" / "x.py").write_text("x = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    subprocess.run([*git, "add", "."], cwd=tmp_path, check=True)
    subprocess.run([*git, "commit", "-qm", "base"], cwd=tmp_path, check=True)
    return tmp_path


def affected(repo: Path, change: str | None, **env: str) -> str:
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
    base = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, check=True
    ).stdout.strip()
    if change is not None:
        path = repo / change
        path.write_text(path.read_text() + "# changed\n")
        subprocess.run([*git, "commit", "-qam", "change"], cwd=repo, check=True)
    output = repo / "github_output"
    output.write_text("")
    values = {"BASE": base, "ALL": "false", "ONLY": ""} | env
    r = subprocess.run(
        ["bash", "-c", affected_script()],
        cwd=repo,
        env={"PATH": "/usr/bin:/bin", "GITHUB_OUTPUT": str(output), **values},
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    return output.read_text().strip()


@pytest.mark.parametrize(
    ("change", "env", "expected"),
    [
        ("stacks/demand/staging.yaml", {}, '["staging"]'),
        ("stacks/Pulumi.prod.yaml", {}, '["prod"]'),
        ("stacks/Pulumi.paper-core.yaml", {}, "[]"),
        ("solver/x.py", {}, '["dev-gcp","dev","prod","spot","staging"]'),
        (None, {"ALL": "true"}, '["dev-gcp","dev","prod","spot","staging"]'),
        (None, {"ALL": "true", "ONLY": "prod"}, '["prod"]'),
        (None, {"BASE": "0000000000000000000000000000000000000000"}, '["dev-gcp","dev","prod","spot","staging"]'),
    ],
    ids=[
        "demand-file",
        "stack-config",
        "paper-stack-never",
        "code-all",
        "schedule-all",
        "manual-one",
        "new-branch-all",
    ],
)
def test_affected_stacks_step(repo, change, env, expected):
    assert affected(repo, change, **env) == f"stacks={expected}"
