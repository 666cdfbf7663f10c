"""Parameters: every shipped set validates; bad input is named with its fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsr1kit import params as P
from dsr1kit.run import parameters_cell

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted(ROOT.glob("params/*/*.yaml"))
# Overlays (params/SET/NAME/STEP.yaml): a benchmark's keys, layered on the set's own STEP.yaml.
OVERLAYS = sorted(ROOT.glob("params/*/*/*.yaml"))


def test_params_sets_are_shipped():
    assert {f.parent.name for f in SHIPPED} >= {"tiny", "r1-671b-2x8h100"}
    assert {f.stem for f in SHIPPED if f.parent.name == "tiny"} == set(P.MODELS)


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_shipped_params_file_validates(path):
    p = P.load(path.stem, [path])
    assert p.notebook == path.stem


@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}/{p.stem}")
def test_every_overlay_validates_on_its_set(path):
    base = path.parent.parent / path.name
    p = P.load(path.stem, [base, path])
    assert p.notebook == path.stem and base.is_file()
    command = " ".join(path.read_text().splitlines()[:3])
    assert f"{base.relative_to(ROOT)} -f {path.relative_to(ROOT)}" in command


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_every_shipped_params_file_starts_with_its_command(path):
    head = path.read_text().splitlines()[:3]
    launchers = ("dsr1kit run", "sbatch", "slurm/forgetting_sweep.sh")
    assert any(any(word in line for word in launchers) and path.name in line for line in head)


def test_r1_benchmark_overlays_read_their_benchmarks():
    from dsr1kit.benchmarks.registry import adapter_by_repo

    d = ROOT / "params" / "r1-671b-2x8h100"
    for name, adapter in (("hle", "HLE"), ("medmcqa", "MedMCQA")):
        p = P.load("10_vllm_inference", [d / "10_vllm_inference.yaml", d / name / "10_vllm_inference.yaml"])
        assert adapter_by_repo(p.eval_dataset).name == adapter and p.model == "deepseek-ai/DeepSeek-R1-0528"


def test_r1_set_carries_the_recipe_values():
    d = ROOT / "params" / "r1-671b-2x8h100"
    infer = P.load("10_vllm_inference", [d / "10_vllm_inference.yaml"])
    hari = P.load("20_hari_training", [d / "20_hari_training.yaml"])
    assert (infer.tensor_parallel_size, infer.enable_expert_parallel, infer.gpu_memory_utilization) == (
        16,
        True,
        0.90,
    )
    assert infer.distributed_executor_backend == "ray"
    assert (hari.lora_r, hari.lora_alpha, hari.lr, hari.lambda_kl, hari.kl_temperature, hari.max_len) == (
        4,
        8,
        5e-5,
        0.9,
        1.5,
        4096,
    )
    assert hari.quantization == "nf4"


def test_unknown_key_names_it_and_lists_valid_keys():
    with pytest.raises(P.ParamsError) as err:
        P.load("20_hari_training", overrides={"learning_rate": 1e-4})
    msg = str(err.value)
    assert "unknown key 'learning_rate'" in msg
    assert "valid keys:" in msg and "lr" in msg and "lambda_kl" in msg


def test_wrong_type_names_key_value_and_expected_type():
    with pytest.raises(P.ParamsError) as err:
        P.load("20_hari_training", overrides={"batch_size": "four"})
    assert "'batch_size': value 'four' (str) is not a valid int" in str(err.value)


def test_every_problem_is_reported_at_once():
    with pytest.raises(P.ParamsError) as err:
        P.load("20_hari_training", overrides={"lr": "x", "epochz": 1, "kl_tokens": "some"})
    assert len(err.value.problems) == 3


@pytest.mark.parametrize(
    "key,value",
    [
        ("hf_token", "abc"),
        ("HF_TOKEN", "abc"),
        ("openai_api_key", "abc"),
        ("wandb_api_key", "abc"),
        ("model", "hf_" + "a" * 34),
    ],
)
def test_secret_like_parameter_is_refused_with_env_hint(key, value):
    with pytest.raises(P.ParamsError) as err:
        P.load("10_vllm_inference", overrides={key: value})
    msg = str(err.value)
    assert "looks like a secret" in msg and "export" in msg
    assert value not in msg  # the error itself must not echo the secret


def test_token_count_knobs_are_not_mistaken_for_secrets():
    p = P.load("10_vllm_inference", overrides={"max_new_tokens": 8, "max_num_batched_tokens": 64})
    assert p.max_new_tokens == 8


@pytest.mark.parametrize(
    "raw,parsed", [("3", 3), ("0.5", 0.5), ("[a, b]", ["a", "b"]), ("true", True), ("x", "x"), ("", "")]
)
def test_overrides_are_parsed_as_yaml(raw, parsed):
    assert P.parse_override(raw) == parsed


def test_yaml_that_is_not_a_mapping_is_an_error(tmp_path):
    bad = tmp_path / "20_hari_training.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(P.ParamsError, match="mapping"):
        P.load("20_hari_training", [bad])


@pytest.mark.parametrize("notebook", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_notebook_parameters_cell_is_the_rendering_of_its_model(notebook):
    """The committed cell is exactly what dsr1kit.params renders: a default lives in one file."""
    model = P.model_for(notebook)
    assert parameters_cell.committed_source(notebook) == parameters_cell.render(model), (
        f"{notebook.name}: parameters cell differs from dsr1kit/params.py; run `dsr1kit parameters-cell`"
    )


@pytest.mark.parametrize("model", list(P.MODELS.values()), ids=lambda m: m.__name__)
def test_rendered_cell_defines_exactly_the_model_defaults(model):
    namespace: dict = {}
    exec(parameters_cell.render(model), namespace)
    assert {k for k in namespace if not k.startswith("__")} == set(model.keys())
    assert model.from_namespace(namespace).to_dict() == model().to_dict()


@pytest.mark.parametrize("model", list(P.MODELS.values()), ids=lambda m: m.__name__)
def test_every_parameter_has_help_text(model):
    missing = [k for k in model.keys() if not (model.model_fields[k].description or "").strip()]
    assert not missing, f"{model.__name__}: no description for {missing}"


def test_changing_a_default_is_a_change_of_params_py_alone(monkeypatch):
    """A changed default reaches the rendered cell and the tiny parameter set with no other file edited."""
    from pydantic import Field

    class Changed(P.HariParams):
        kl_temperature: float = Field(2.5, gt=0, description="Softmax temperature T of the KL term")

    monkeypatch.setitem(P.MODELS, "20_hari_training", Changed)
    assert "kl_temperature = 2.5" in parameters_cell.render(Changed)
    assert parameters_cell.render(Changed) != parameters_cell.committed_source(
        ROOT / "notebooks/20_hari_training.ipynb"
    )
    assert P.load("20_hari_training", [ROOT / "params/tiny/20_hari_training.yaml"]).kl_temperature == 2.5
    assert P.load("20_hari_training").kl_temperature == 2.5  # `dsr1kit run` without -f
    others = [f for f in ROOT.glob("params/*/*.yaml") if "kl_temperature" in f.read_text()]
    assert not others, f"{others} repeat a default"


def test_tiny_parameter_files_hold_no_keys():
    """The tiny set is the typed defaults: its files are their command header alone."""
    for path in sorted(ROOT.glob("params/tiny/*.yaml")):
        assert P.read_yaml(path) == {}, f"{path} repeats defaults: {sorted(P.read_yaml(path))}"


# A parameter set layered on another (`-f base -f layer`) differs from the base, not from the defaults.
LAYERED_ON = {"r1-rehearsal": "r1-671b-2x8h100"}


@pytest.mark.parametrize(
    "path", [p for p in SHIPPED if p.parent.name != "tiny"], ids=lambda p: f"{p.parent.name}/{p.stem}"
)
def test_parameter_files_hold_only_real_differences(path):
    base_dir = LAYERED_ON.get(path.parent.name)
    base_files = [ROOT / "params" / base_dir / path.name] if base_dir else []
    base = P.load(path.stem, base_files).to_dict()
    mine = P.load(path.stem, [*base_files, path]).to_dict()
    same = [k for k in P.read_yaml(path) if mine[k] == base[k]]
    assert not same, f"{path.relative_to(ROOT)} sets {same} to the value it already has"


def test_an_empty_adapter_dir_says_what_to_give():
    with pytest.raises(P.ParamsError) as err:
        P.load("30_adapter_inspection", overrides={"adapter_dir": ""})
    assert "'adapter_dir'" in str(err.value) and "'latest'" in str(err.value)


@pytest.mark.parametrize("notebook", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_papermill_reads_every_parameter_of_the_cell(notebook):
    """papermill parses each line of the cell; one it cannot read makes its `-p` override 'unknown' in every run."""
    import papermill

    assert set(papermill.inspect_notebook(str(notebook))) == set(P.model_for(notebook).keys())


@pytest.mark.parametrize("notebook", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.stem)
def test_committed_notebooks_carry_no_outputs(notebook):
    nb = json.loads(notebook.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            assert not cell.get("outputs") and cell.get("execution_count") is None


def test_client_keeps_the_engine_batch_full_unless_told_otherwise():
    from dsr1kit.params import InferenceParams

    assert InferenceParams(max_num_seqs=16).client_concurrency == 32
    assert InferenceParams(max_num_seqs=16, data_parallel_size=2).client_concurrency == 64
    assert InferenceParams(max_num_seqs=16, concurrency=5).client_concurrency == 5
