"""The environment fingerprint and `flashdraft doctor`: what is recorded, how changes rank, no secrets."""

import copy
import json
import platform
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import typer
from typer.testing import CliRunner

import flashdraft.model
from flashdraft.cli import doctor
from flashdraft.cli.doctor import Check, check_cache_writable, doctor_cmd
from flashdraft.run.fingerprint import code_hash, diff_fingerprints, fingerprint, git_state

MODEL_DIR = Path(flashdraft.model.__file__).parent


@pytest.fixture(scope="module")
def current() -> dict:
    return fingerprint()


def invoke_doctor(*args: str):
    app = typer.Typer()
    app.command("doctor")(doctor_cmd)
    return CliRunner().invoke(app, list(args))


def git(repo: Path, *args: str) -> str:
    cmd = ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args]
    return subprocess.run(cmd, cwd=repo, check=True, capture_output=True, text=True).stdout.strip()


def test_fingerprint_records_interpreter_libraries_packages_project_model_code_and_cache(tmp_path):
    (tmp_path / "cache" / "sub").mkdir(parents=True)
    (tmp_path / "cache" / "sub" / "blob").write_bytes(b"x" * 1000)
    fp = fingerprint(compile_cache_dir=tmp_path / "cache", extra={"throughput": {"ctx_tok_s": 1.5}})

    assert fp["python"]["version"] == platform.python_version()
    assert fp["libraries"]["torch"] == torch.__version__
    assert fp["libraries"]["cuda"] == torch.version.cuda
    assert fp["libraries"]["transformers"] == fp["packages"]["transformers"]
    assert {"torch", "typer", "pytest"} <= fp["packages"].keys()
    assert fp["gpu"]["count"] == torch.cuda.device_count()
    assert fp["project"]["commit"] == git(MODEL_DIR, "rev-parse", "HEAD")
    assert fp["model_code"] == code_hash(MODEL_DIR)
    assert {"drafter.py", "target.py"} <= fp["model_code"]["files"].keys()
    assert fp["compile_cache"] == {"dir": str(tmp_path / "cache"), "present": True, "size_bytes": 1000}
    assert fp["throughput"] == {"ctx_tok_s": 1.5}
    json.dumps(fp)


def test_missing_compile_cache_is_recorded_absent(tmp_path):
    cache = fingerprint(compile_cache_dir=tmp_path / "nope")["compile_cache"]
    assert cache["present"] is False and cache["size_bytes"] == 0


def test_uncommitted_hash_follows_edits_and_untracked_files(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\n")
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "a.py")
    git(tmp_path, "commit", "-qm", "init")
    clean = git_state(tmp_path)
    assert clean["commit"] == git(tmp_path, "rev-parse", "HEAD") and clean["uncommitted"] is None

    (tmp_path / "a.py").write_text("x = 2\n")
    edited = git_state(tmp_path)["uncommitted"]
    (tmp_path / "new.py").write_text("y = 1\n")
    with_untracked = git_state(tmp_path)["uncommitted"]
    (tmp_path / "new.py").write_text("y = 2\n")
    untracked_edited = git_state(tmp_path)["uncommitted"]
    assert len({edited, with_untracked, untracked_edited} - {None}) == 3


def test_untracked_broken_link_is_hashed_by_its_target(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "link").symlink_to("missing-a")
    first = git_state(tmp_path)["uncommitted"]
    (tmp_path / "link").unlink()
    (tmp_path / "link").symlink_to("missing-b")
    assert first is not None and git_state(tmp_path)["uncommitted"] != first


def test_outside_a_git_repository_there_is_no_commit(tmp_path):
    state = git_state(tmp_path)
    assert state["git"] is False and state["commit"] is None and state["uncommitted"] is None


def test_model_code_hash_depends_on_content_not_location(tmp_path):
    copy_dir = shutil.copytree(MODEL_DIR, tmp_path / "model", ignore=shutil.ignore_patterns("__pycache__"))
    assert code_hash(copy_dir) == code_hash(MODEL_DIR)
    with open(copy_dir / "drafter.py", "a") as f:
        f.write("# edited\n")
    edited = code_hash(copy_dir)
    assert edited["hash"] != code_hash(MODEL_DIR)["hash"]
    assert edited["files"]["target.py"] == code_hash(MODEL_DIR)["files"]["target.py"]


def fabricated_old(current: dict, tmp_path: Path) -> dict:
    """`current` as it was before someone edited drafter.py and upgraded typer."""
    old = copy.deepcopy(current)
    copy_dir = shutil.copytree(MODEL_DIR, tmp_path / "model", ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy_dir / "drafter.py", "a") as f:
        f.write("# the version that worked\n")
    old["model_code"] = code_hash(copy_dir)
    old["packages"]["typer"] = "0.0.1"
    old["libraries"]["torch"] = "2.0.0"
    old["compile_cache"]["size_bytes"] += 1
    old["created"] = "2000-01-01T00:00:00+00:00"
    old["throughput"] = {"ctx_tok_s": 12345.0, "loss": 0.3903, "step": 1072}
    return old


def test_diff_ranks_torch_then_model_code_then_packages_then_cache(current, tmp_path):
    changes = diff_fingerprints(fabricated_old(current, tmp_path), current)
    assert [(c.rank, c.key) for c in changes] == [
        (1, "libraries.torch"),
        (2, "model_code.files.drafter.py"),
        (2, "model_code.hash"),
        (4, "packages.typer"),
        (5, "compile_cache.size_bytes"),
    ]
    typer_change = changes[3]
    assert (typer_change.group, typer_change.old, typer_change.new) == (
        "other packages and system",
        "0.0.1",
        current["packages"]["typer"],
    )


def test_diff_reports_added_and_removed_packages_and_key_libraries(current):
    old = copy.deepcopy(current)
    old["packages"]["gone-package"] = "1.0"
    old["packages"]["safetensors"] = "0.0.1"
    del old["packages"]["pytest"]
    changes = {c.key: c for c in diff_fingerprints(old, current)}
    assert changes["packages.gone-package"].new is None and changes["packages.gone-package"].rank == 4
    assert changes["packages.pytest"].old is None
    assert changes["packages.safetensors"].rank == 3


def test_identical_fingerprints_differ_in_nothing_but_time(current):
    later = copy.deepcopy(current) | {"created": "later", "throughput": {"ctx_tok_s": 2.0}}
    assert diff_fingerprints(current, later) == []


def test_no_secret_reaches_the_fingerprint(monkeypatch):
    """An allow-list: names that no pattern of secret-like words catches stay out too."""
    secret = "s3cr3t-xyz-4242"
    names = ("AWS_SECRET_ACCESS_KEY", "HF_TOKEN", "TORCH_FAKE_TOKEN", "NCCL_PASSWORD", "CUDA_API_KEY",
             "TORCH_STORE_PWD", "TRITON_REMOTE_CACHE_CREDS", "NCCL_IB_HCA_PRIVATE")  # fmt: skip
    for name in names:
        monkeypatch.setenv(name, secret)
    monkeypatch.setenv("NCCL_DEBUG", "WARN")
    text = json.dumps(fingerprint())
    assert secret not in text
    assert '"NCCL_DEBUG": "WARN"' in text


def write_run(run: Path, checkpoint_fp: dict | None, run_fp: dict | None) -> None:
    ckpts = run / "checkpoints"
    ckpts.mkdir(parents=True)
    if checkpoint_fp is not None:
        (ckpts / "step_000010").mkdir()
        (ckpts / "step_000010" / "env.json").write_text(json.dumps(checkpoint_fp))
        (ckpts / "LATEST").write_text("step_000010\n")
    if run_fp is not None:
        (run / "env.json").write_text(json.dumps(run_fp))


def test_doctor_run_shows_ranked_changes_of_the_latest_checkpoint_and_its_throughput(tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    cache = tmp_path / "inductor"  # a cache nothing else writes to while the test runs
    cache.mkdir()
    (cache / "entry").write_bytes(b"x" * 100)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    current = fingerprint()
    write_run(tmp_path / "run", fabricated_old(current, tmp_path), run_fp={"created": "run start"})
    result = invoke_doctor(str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    out = result.output
    assert "step_000010" in out and "2000-01-01" in out
    assert "compile_cache.size_bytes" in out, out
    assert out.index("model_code.hash") < out.index("packages.typer") < out.index("compile_cache.size_bytes")
    assert "0.0.1" in out and current["packages"]["typer"] in out
    assert "ctx_tok_s 12,345; loss 0.39; step 1,072" in out


def test_doctor_run_falls_back_to_the_run_fingerprint(current, tmp_path, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    old = copy.deepcopy(current)
    old["packages"]["typer"] = "0.0.1"
    write_run(tmp_path / "run", checkpoint_fp=None, run_fp=old)
    result = invoke_doctor(str(tmp_path / "run"))
    assert result.exit_code == 0, result.output
    assert "packages.typer" in result.output and "throughput then: not recorded" in result.output


def test_doctor_run_without_fingerprint_is_an_error(tmp_path):
    result = invoke_doctor(str(tmp_path))
    assert result.exit_code == 2 and "no fingerprint" in result.output


def test_unwritable_compile_cache_fails_its_check(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert check_cache_writable(blocker / "cache").ok is False
    assert check_cache_writable(tmp_path / "cache").ok is True


def test_doctor_checks_the_compile_cache_training_uses(tmp_path, monkeypatch):
    """flashdraft's own cache under XDG_CACHE_HOME, or the TORCHINDUCTOR_CACHE_DIR the user set; not
    inductor's default, which training does not use."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setattr(doctor, "check_flex_attention", lambda device: Check("flex_attention", True, "stub"))

    def cache_check() -> Check:
        return next(c for c in doctor.health_checks() if c.name == "compile cache")

    ours = cache_check()
    assert ours.ok and ours.detail.startswith(f"{tmp_path / 'xdg' / 'flashdraft' / 'inductor'}/torch-")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_check().detail.startswith(f"{tmp_path / 'mine'} writable")


def test_doctor_exits_non_zero_when_a_check_fails(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(blocker / "cache"))
    monkeypatch.setattr(doctor, "check_flex_attention", lambda device: Check("flex_attention", True, "stub"))
    result = invoke_doctor()
    assert result.exit_code == 1 and "FAIL" in result.output


@pytest.mark.slow
def test_doctor_without_run_reports_flex_attention_compiled_on_this_machine(monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    result = invoke_doctor()
    assert result.exit_code == 0, result.output
    expected_gpu = "CPU only" if not torch.cuda.is_available() else "driver"
    assert expected_gpu in result.output
    assert "compiled and ran on" in result.output
