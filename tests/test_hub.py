"""Hub ids everywhere a checkpoint is accepted, served offline from a real Hugging Face cache layout.

A temporary ``HF_HOME`` holds tiny checkpoints (spiffy's own writers) under the five real ids; with
``HF_HUB_OFFLINE=1`` every by-id call below goes through huggingface_hub's ``snapshot_download`` against that cache.
Nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import spiffy
from hf_cache import REAL_IDS, add_snapshot, repo_folder
from mktestdocs import grab_code_blocks
from test_readme import commands
from huggingface_hub import constants as hf_constants
from huggingface_hub import scan_cache_dir

from spiffy.arspec import ddtree_generate
from spiffy.models import load_drafter, load_target, make_tiny_dflash
from spiffy.checkpoint_ref import checkpoint_name, hub_id_from_cache_path, parse_hub_id, split_reference
from spiffy.cli.main import main
from spiffy.decoding import DecodeConfig, make_session
from spiffy.api import generate
from spiffy.selfspec.graph import runtime_signature as decoding_runtime_signature
from spiffy.errors import CheckpointError, CheckpointNotCachedError, ConfigError
from spiffy.models import load_model, load_tokenizer
from spiffy.models.hub import resolve_checkpoint
from spiffy.selfspec.calibrate import calibrate
from spiffy.selfspec.graph import GraphCompatibilityWarning, load_graph
from spiffy.selfspec.prompts import prompt_token_ids

REPO = Path(__file__).resolve().parent.parent
LLADA = REAL_IDS["llada"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_llada, tiny_dream, tiny_sdar, tiny_qwen3) -> SimpleNamespace:
    """A Hugging Face home whose cache holds tiny checkpoints under the five real ids (plus a second LLaDA
    commit reachable by hash and by tag ``v2``, and a repository whose weight shards are missing)."""
    root = tmp_path_factory.mktemp("hub")
    home = root / "hf_home"
    cache = home / "hub"
    drafter = make_tiny_dflash(root / "drafter", tiny_qwen3, seed=1, block_size=4)
    sources = {"llada": tiny_llada, "dream": tiny_dream, "sdar": tiny_sdar, "qwen3": tiny_qwen3, "dflash": drafter}
    from spiffy.models.tiny import make_tiny

    other = make_tiny("llada", root / "llada-seed7", seed=7)
    old_commit = add_snapshot(cache, LLADA, other, refs=("v2",))
    commits = {fam: add_snapshot(cache, REAL_IDS[fam], src) for fam, src in sources.items()}
    add_snapshot(cache, "GSAI-ML/LLaDA-8B-Base", tiny_llada, skip=("model-00002-of-00003.safetensors",))
    return SimpleNamespace(home=home, cache=cache, sources=sources, commits=commits, other=other, old_commit=old_commit)


@pytest.fixture
def offline(hub, monkeypatch) -> SimpleNamespace:
    """``HF_HOME=<hub.home>`` and ``HF_HUB_OFFLINE=1`` for this test. huggingface_hub reads both variables once, at
    import, into its ``constants``; they are set there too, to what a fresh import would read."""
    monkeypatch.setenv("HF_HOME", str(hub.home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setattr(hf_constants, "HF_HOME", str(hub.home))
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(hub.cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    return hub


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


# ---------------------------------------------------------------------------------------------------- names
def test_parse_and_name_references() -> None:
    assert parse_hub_id("GSAI-ML/LLaDA-8B-Instruct") == ("GSAI-ML/LLaDA-8B-Instruct", None)
    assert parse_hub_id("Qwen/Qwen3-8B@main") == ("Qwen/Qwen3-8B", "main")
    assert parse_hub_id("z-lab/Qwen3-8B-DFlash-b16@refs/pr/1") == ("z-lab/Qwen3-8B-DFlash-b16", "refs/pr/1")
    for path in ("/abs/dir", "./dir", "dir", "a/b/c", "~/x", "../x", "a/", "a//b", "a/b@", "-a/b", "a--b/c", ""):
        assert parse_hub_id(path) is None, path
    snap = "/h/hub/models--GSAI-ML--LLaDA-8B-Instruct/snapshots/" + "a" * 40
    assert hub_id_from_cache_path(snap) == ("GSAI-ML/LLaDA-8B-Instruct", "a" * 40)
    assert hub_id_from_cache_path("/data/LLaDA-8B-Instruct") is None
    assert split_reference(f"{LLADA}@abc") == (LLADA, "abc")
    assert split_reference(snap) == (LLADA, "a" * 40)
    assert split_reference("/data/x") == ("/data/x", None)
    names = {checkpoint_name(r) for r in (LLADA, f"{LLADA}@abc", snap, "/data/LLaDA-8B-Instruct", "C:\\m\\LLaDA-8B-Instruct")}
    assert names == {"LLaDA-8B-Instruct"}


def test_cache_layout_is_read_by_huggingface_hub(offline) -> None:
    info = {r.repo_id: r for r in scan_cache_dir(offline.cache).repos}
    assert set(REAL_IDS.values()) <= set(info)
    for fam, repo_id in REAL_IDS.items():
        revs = {r.commit_hash: r for r in info[repo_id].revisions}
        assert offline.commits[fam] in revs and "main" in revs[offline.commits[fam]].refs
        files = {f.file_name for f in revs[offline.commits[fam]].files}
        assert "config.json" in files and any(f.endswith(".safetensors") for f in files)
    assert {r.commit_hash for r in info[LLADA].revisions} == {offline.commits["llada"], offline.old_commit}


# ---------------------------------------------------------------------------------------------------- resolve
def test_local_paths_never_touch_the_hub(offline, tiny_llada: Path, tmp_path: Path, monkeypatch) -> None:
    assert resolve_checkpoint(tiny_llada).path == tiny_llada and resolve_checkpoint(tiny_llada).repo_id is None
    with pytest.raises(ConfigError, match="local directory"):
        resolve_checkpoint(tiny_llada, revision="main")
    # a missing path that is not shaped like an id keeps the loader's own error
    for missing in (tmp_path / "nope", "nope", "./a/b"):
        with pytest.raises(CheckpointError, match="does not exist") as err:
            load_model(missing)
        assert not isinstance(err.value, CheckpointNotCachedError)
    # a local directory wins over an id of the same spelling
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny_llada, tmp_path / "GSAI-ML" / "LLaDA-8B-Instruct")
    assert resolve_checkpoint(LLADA).path == Path(LLADA) and resolve_checkpoint(LLADA).repo_id is None
    # a cache snapshot given as a path is recognised as the id it holds
    snap = repo_folder(offline.cache, LLADA) / "snapshots" / offline.commits["llada"]
    assert resolve_checkpoint(snap).reference == f"{LLADA}@{offline.commits['llada']}"


def test_missing_id_gives_one_line_typed_error(offline) -> None:
    for call in (lambda: load_model("GSAI-ML/LLaDA-1.5"), lambda: load_tokenizer("GSAI-ML/LLaDA-1.5"),
                 lambda: load_drafter("z-lab/Qwen3-4B-DFlash-b16"), lambda: load_target("Qwen/Qwen3-4B", torch.float32, "cpu")):
        with pytest.raises(CheckpointNotCachedError) as err:
            call()
        msg = str(err.value)
        assert "\n" not in msg and str(offline.cache) in msg and "HF_HUB_OFFLINE=1" in msg and "hf download" in msg
        assert err.value.repo_id in msg and err.value.cache_dir == str(offline.cache)
    with pytest.raises(CheckpointNotCachedError, match="revision 'v9'"):
        load_model(f"{LLADA}@v9")


def test_snapshot_missing_shards_names_them(offline) -> None:
    with pytest.raises(CheckpointError, match="shard files .* missing.*model-00002-of-00003"):
        load_model("GSAI-ML/LLaDA-8B-Base")


@pytest.mark.parametrize("family", list(REAL_IDS))
def test_load_every_family_by_id(offline, family: str) -> None:
    repo_id, commit = REAL_IDS[family], offline.commits[family]
    by_id = load_model(repo_id, dtype=torch.float64)
    local = load_model(offline.sources[family], dtype=torch.float64)
    assert type(by_id) is type(local)
    _same_weights(by_id, local)
    if family == "dflash":
        _same_weights(load_drafter(repo_id, dtype=torch.float64), local)
    else:
        assert by_id.name_or_path == f"{repo_id}@{commit}"
        tok = load_tokenizer(repo_id)
        assert tok("def add(a, b):")["input_ids"] == load_tokenizer(offline.sources[family])("def add(a, b):")["input_ids"]


def test_revision_by_suffix_argument_and_tag(offline) -> None:
    latest = load_model(LLADA)
    expected_old = load_model(offline.other)
    for old in (load_model(f"{LLADA}@{offline.old_commit}"), load_model(LLADA, revision="v2"), load_model(f"{LLADA}@v2")):
        _same_weights(old, expected_old)
        assert old.name_or_path == f"{LLADA}@{offline.old_commit}"
    with pytest.raises(AssertionError):
        _same_weights(latest, expected_old)
    with pytest.raises(ConfigError, match="give one"):
        load_model(f"{LLADA}@v2", revision="main")


def test_only_the_files_a_loader_needs_are_requested(offline, tiny_qwen3: Path, tmp_path: Path) -> None:
    """huggingface_hub checks a cached snapshot against its cached tree listing (when it has one) for exactly the
    files requested: files the loaders never read may be absent, a requested one may not."""
    tree_cache = pytest.importorskip("huggingface_hub._tree_cache")
    from huggingface_hub import snapshot_download

    repo_id = "Qwen/Qwen3-8B-listed"
    commit = add_snapshot(offline.cache, repo_id, tiny_qwen3)
    snap = repo_folder(offline.cache, repo_id) / "snapshots" / commit
    listed = {p.name: tree_cache.TreeCacheEntry(size=p.stat().st_size, blob_id="0" * 40) for p in snap.iterdir()}
    for extra in ("README.md", "pytorch_model.bin", "model-00009-of-00009.safetensors", "original/consolidated.00.pth"):
        listed[extra] = tree_cache.TreeCacheEntry(size=1, blob_id="0" * 40)  # on the Hub, never fetched by spiffy
    tree_cache.write_tree_cache(str(repo_folder(offline.cache, repo_id)), commit, listed)
    with pytest.raises(Exception, match="incomplete"):
        snapshot_download(repo_id)  # everything: the listing is in force
    _same_weights(load_model(repo_id), load_model(tiny_qwen3))
    (snap / "tokenizer.json").unlink()  # a file the loaders do read
    with pytest.raises(CheckpointError, match="incomplete.*hf download"):
        load_tokenizer(repo_id)


# ---------------------------------------------------------------------------------------------------- use by id
@pytest.mark.parametrize("family", ["llada", "dream", "sdar"])
def test_generate_by_id_equals_local(offline, family: str) -> None:
    cfg = DecodeConfig(gen_length=8, block_length=4)
    out = []
    for ref in (REAL_IDS[family], offline.sources[family]):
        model, tok = load_model(ref, dtype=torch.float64), load_tokenizer(ref)
        ids = torch.tensor([prompt_token_ids(tok, "def add(a, b):", chat=False)])
        out.append(generate(model, ids, cfg, tokenizer=tok).tokens)
    assert out[0] == out[1]


def test_calibrate_by_id_records_id_and_revision(offline, tmp_path: Path) -> None:
    model, tok = load_model(LLADA, dtype=torch.float64), load_tokenizer(LLADA)
    cfg = DecodeConfig(gen_length=8, block_length=4)
    prompts = ["def add(a, b):", "import os\nprint("]
    graph = calibrate(model, tok, prompts, cfg, nodes=4, progress=False, chat=False)
    graph.save(tmp_path / "g.json")
    cf = json.loads((tmp_path / "g.json").read_text())["calibrated_for"]
    assert cf["model"] == LLADA and cf["model_revision"] == offline.commits["llada"]
    assert list(cf)[:3] == ["family", "model", "model_revision"]
    graph = load_graph(tmp_path / "g.json")
    ids = torch.tensor([prompt_token_ids(tok, prompts[0], chat=False)])
    # recognised for the model loaded by id, by its cache snapshot path, and by a local copy of the same name
    snap = repo_folder(offline.cache, LLADA) / "snapshots" / offline.commits["llada"]
    copy = tmp_path / "LLaDA-8B-Instruct"
    shutil.copytree(offline.sources["llada"], copy)
    for ref in (LLADA, snap, copy):
        loaded = load_model(ref, dtype=torch.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("error", GraphCompatibilityWarning)
            graph.check_compatible(decoding_runtime_signature(loaded, make_session(loaded, ids, cfg)))
    # a model known only by its cache snapshot path (e.g. loaded with transformers) is the same model
    with warnings.catch_warnings():
        warnings.simplefilter("error", GraphCompatibilityWarning)
        graph.check_compatible({"model": str(snap)})
    by_path = calibrate(model, tok, prompts[:1], cfg, nodes=2, progress=False, chat=False, model_name=str(snap))
    assert by_path.calibrated_for["model"] == LLADA and by_path.calibrated_for["model_revision"] == offline.commits["llada"]
    other = tmp_path / "some-other-model"
    shutil.copytree(offline.sources["llada"], other)
    loaded = load_model(other, dtype=torch.float64)
    with pytest.warns(GraphCompatibilityWarning, match="model"):
        graph.check_compatible(decoding_runtime_signature(loaded, make_session(loaded, ids, cfg)))
    # Spiffy with the graph, by id: the baseline's tokens
    base = generate(model, ids, cfg, tokenizer=tok)
    spec = generate(model, ids, cfg, tokenizer=tok, graph=graph, budget=len(graph))
    assert spec.tokens == base.tokens


def test_ddtree_by_id_equals_ar(offline) -> None:
    target = load_target(REAL_IDS["qwen3"], torch.float64, "cpu")
    drafter = load_drafter(REAL_IDS["dflash"], dtype=torch.float64)
    tok = load_tokenizer(REAL_IDS["qwen3"])
    ids = tok("def add(a, b):")["input_ids"]
    tree = ddtree_generate(target, drafter, ids, method="ddtree", budget=8, max_new_tokens=12)
    plain = ddtree_generate(target, None, ids, method="ar", max_new_tokens=12)
    assert tree.tokens == plain.tokens and len(tree.tokens) == 12


# ---------------------------------------------------------------------------------------------------- command line
def test_cli_commands_by_id(offline, tmp_path: Path, capsys) -> None:
    common = ["--prompt", "def add(a, b):", "--json", "--no-progress"]
    assert main(["generate", "--target", REAL_IDS["qwen3"], "--drafter", REAL_IDS["dflash"], "--method", "ddtree",
                 "--max-new-tokens", "6", *common]) == 0
    ar = json.loads(capsys.readouterr().out)
    assert main(["generate", "--target", REAL_IDS["qwen3"], "--method", "ar", "--max-new-tokens", "6", *common]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == ar["tokens"]
    out = tmp_path / "graph.json"
    assert main(["calibrate", "--model", REAL_IDS["sdar"], "--prompts", "default", "--max-prompts", "1", "--nodes", "3",
                 "--gen-length", "8", "--block-length", "4", "--no-progress", "--out", str(out)]) == 0
    cf = json.loads(out.read_text())["calibrated_for"]
    assert cf["model"] == REAL_IDS["sdar"] and cf["model_revision"] == offline.commits["sdar"]
    capsys.readouterr()
    assert main(["generate", "--model", "GSAI-ML/LLaDA-1.5", *common]) == 2
    err = capsys.readouterr().err
    assert "GSAI-ML/LLaDA-1.5" in err and str(offline.cache) in err


def test_readme_real_checkpoint_blocks_run_against_the_cache(offline, tmp_path: Path, monkeypatch, capsys) -> None:
    """The "Real checkpoints" commands (docs/MODELS.md) and Python lines, as written, against the offline cache (sizes made
    small with the flags a user would append; ``device="cuda"`` becomes the CPU where there is no GPU)."""
    readme = (REPO / "docs" / "MODELS.md").read_text(encoding="utf-8")  # the README's "Real checkpoints" section
    shell = [b for b in grab_code_blocks(readme, lang="bash") if LLADA in b]
    python = [b for b in grab_code_blocks(readme, lang="python") if REAL_IDS["sdar"] in b]
    assert len(shell) == 1 and len(python) == 1
    monkeypatch.chdir(tmp_path)
    small = {  # the flags a user would append to make each command cheap
        "calibrate": ["--max-prompts", "1", "--nodes", "3", "--gen-length", "8", "--block-length", "4"],
        "generate-ar": ["--max-new-tokens", "6"],
        "generate": ["--gen-length", "8", "--block-length", "4"],
    }
    for argv in commands(shell[0]):
        assert argv[0] == "spiffy", argv
        kind = "generate-ar" if argv[1] == "generate" and "--target" in argv else argv[1]
        extra = small[kind] + ["--no-progress"]
        code = main(argv[1:] + extra)
        assert code == 0, (argv, capsys.readouterr().err[-2000:])
    assert (tmp_path / "dream.json").is_file()
    code = python[0] if torch.cuda.is_available() else python[0].replace('device="cuda"', 'device="cpu"')
    namespace: dict = {"__name__": "readme", "spiffy": spiffy}
    exec(compile(code, "README.md (real checkpoints)", "exec"), namespace)  # noqa: S102 - the README's own code
    assert namespace["model"].name_or_path.startswith(LLADA + "@")


def _spiffy(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spiffy.cli.main", *args], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=300)


@pytest.mark.slow
def test_spiffy_generate_by_id_from_the_command_line(hub) -> None:
    """Real environment variables only (a fresh process): HF_HOME + HF_HUB_OFFLINE=1."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    env.update(HF_HOME=str(hub.home), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    args = ["--prompt", "def add(a, b):", "--gen-length", "8", "--block-length", "4", "--json", "--no-progress"]
    by_id = _spiffy(["generate", "--model", LLADA, *args], env)
    assert by_id.returncode == 0, by_id.stderr
    model, tok = load_model(hub.sources["llada"]), load_tokenizer(hub.sources["llada"])  # float32, as the CLI on CPU
    ids = torch.tensor([prompt_token_ids(tok, "def add(a, b):")])  # the chat template: the CLI's default
    local = generate(model, ids, DecodeConfig(gen_length=8, block_length=4), tokenizer=tok)
    assert json.loads(by_id.stdout)["tokens"] == local.tokens[0]
    missing = _spiffy(["generate", "--model", "GSAI-ML/LLaDA-1.5", *args], env)
    assert missing.returncode == 2
    assert "GSAI-ML/LLaDA-1.5" in missing.stderr and str(hub.cache) in missing.stderr
    assert "HF_HUB_OFFLINE=1" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1


def test_bare_name_resolves_to_a_shipped_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--target small-qwen3`: a bare name (no Hub id has one) of a checkpoint the package ships is that checkpoint;
    an existing local directory of the same name wins, and an unknown name stays a (missing) path."""
    from spiffy.models.hub import EMBEDDED_ENV_VAR, embedded_models_dir, resolve_checkpoint

    assert resolve_checkpoint("tiny-qwen3").path == embedded_models_dir() / "tiny-qwen3"
    shipped = tmp_path / "shipped"
    (shipped / "pair-target").mkdir(parents=True)
    (shipped / "pair-target" / "config.json").write_text("{}")
    monkeypatch.setenv(EMBEDDED_ENV_VAR, str(shipped))
    assert resolve_checkpoint("pair-target").path == shipped / "pair-target"
    assert resolve_checkpoint("no-such-model").path == Path("no-such-model")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pair-target").mkdir()
    assert resolve_checkpoint("pair-target").path == Path("pair-target")
