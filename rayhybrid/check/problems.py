"""What is wrong with a node, from its facts against the driver's and the topology's: one
`Problem` each, with the fix. Pure (no Ray, no store).

    problems = node_problems(node, facts, driver, tp=2, gpu=True, settings)
    print(problem.line)    # node 1a2b3c4d (10.0.0.5): torch 2.12.0, the driver has 2.13.0; install ...
"""

from __future__ import annotations

from dataclasses import dataclass

FATAL_PACKAGES = ("torch", "rayhybrid")
"""A node whose version of these differs from the driver's stops a run at its start (exit 2):
its ranks would run other code than the others (other collectives, another checkpoint format,
another training step), which ends in a hang or in wrong numbers, never in a clear error."""


@dataclass(frozen=True)
class Problem:
    node: str
    """The node as the line names it: `node 1a2b3c4d (10.0.0.5)`."""
    what: str
    fix: str
    fatal: bool = False
    """At the start of a run: stop it (cluster.check=brief), not only warn."""

    @property
    def line(self) -> str:
        return f"{self.node}: {self.what}; {self.fix}"


def public(version: str | None) -> str | None:
    """A version without its local label: 2.13.0+cu128 and 2.13.0+cpu are one torch release."""
    return version.split("+", 1)[0] if version else version


def package_problems(node: str, facts: dict, driver: dict) -> list[Problem]:
    """The Python version (major.minor), each package against the driver's (missing on the node,
    or another release), and rayhybrid's code when the versions agree."""
    out = []
    mine, theirs = driver["python"], facts["python"]
    if mine.split(".")[:2] != theirs.split(".")[:2]:
        out.append(
            Problem(node, f"Python {theirs}, the driver has {mine}", f"run Python {mine} there (Ray needs one version)")
        )
    for name, want in driver["packages"].items():
        have = facts["packages"].get(name)
        fatal = name in FATAL_PACKAGES
        if want is None or public(have) == public(want):
            continue
        what = f"{name} is not installed" if have is None else f"{name} {have}, the driver has {want}"
        fix = f"install {name}=={public(want)} there"
        if have is not None:
            fix += f", or run the driver with {name}=={public(have)}"
        out.append(Problem(node, what, fix, fatal))
    same = public(facts["packages"].get("rayhybrid")) == public(driver["packages"].get("rayhybrid"))
    if same and facts.get("code") != driver.get("code"):
        out.append(
            Problem(
                node,
                f"rayhybrid's code differs from the driver's (digest {facts.get('code')} against "
                f"{driver.get('code')}, same version: another checkout or an older install)",
                "install the driver's rayhybrid there (pip install <the driver's checkout>)",
            )
        )
    return out


def device_problems(node: str, facts: dict, tp: int, ray_gpus: float, gpu: bool) -> list[Problem]:
    """On GPUs: torch must see the GPUs Ray gives the node, and a tensor-parallel group's tp."""
    d = facts["devices"]
    if not gpu:
        return []
    seen = int(d.get("count", 0))
    if d.get("error"):
        return [Problem(node, f"torch cannot list its GPUs ({d['error']})", "reinstall torch there with CUDA")]
    out = []
    if seen < ray_gpus:
        out.append(
            Problem(
                node,
                f"torch sees {seen} GPU(s) (CUDA {d.get('cuda')}), Ray gives the node {ray_gpus:g}",
                "install a CUDA build of torch there and check the driver (nvidia-smi), CUDA_VISIBLE_DEVICES "
                "and `ray start --num-gpus`",
            )
        )
    if seen < tp:
        out.append(
            Problem(
                node,
                f"a tensor-parallel group needs {tp} GPUs on one node (topology.tp={tp}), torch sees {seen}",
                "fix the node's GPUs, or lower topology.tp",
            )
        )
    if not d.get("nccl", True):
        out.append(Problem(node, "torch has no NCCL", "install a CUDA build of torch with NCCL there"))
    return out


STORE_FIX = (
    "give the node the store's endpoint and credentials (AWS_*, FSSPEC_* or ~/.aws on the node), "
    "set them in checkpoint.storage_options, or use a mount every node shares"
)
DATA_FIX = "put the data on a mount every node shares or in a bucket, or fix data.storage_options"


def storage_problems(node: str, facts: dict, store_display: str) -> list[Problem]:
    out = []
    if facts.get("store"):
        out.append(Problem(node, f"checkpoint.dir {store_display}: {facts['store']}", STORE_FIX))
    for setting, reason in (facts.get("datasets") or {}).items():
        if reason:
            out.append(Problem(node, f"{setting}: {reason}", DATA_FIX))
    return out


def node_problems(node: str, facts: dict | str, driver: dict, *, tp: int, ray_gpus: float, gpu: bool, store: str):
    """Every problem of one node: `facts` is its answer, or why none came (a str)."""
    if isinstance(facts, str):
        return [
            Problem(
                node,
                facts,
                "look at the node's Ray logs (/tmp/ray/session_latest/logs there); a node that cannot run a task "
                "cannot run a rank",
            )
        ]
    return [
        *package_problems(node, facts, driver),
        *device_problems(node, facts, tp, ray_gpus, gpu),
        *storage_problems(node, facts, store),
    ]
