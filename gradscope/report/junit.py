"""A check report as JUnit XML (``check --junit FILE``), the format CI dashboards read.

One ``<testcase>`` per checked tensor, in the suite ``gradscope check``: its ``classname`` is
``gradscope.check.`` followed by the layer (the tensor name's first part; the model's inputs
are ``inputs``, the loss ``model``), its ``name`` the tensor. A tensor a witness disagrees
with has a ``<failure>`` whose message is the first disagreement and whose text is the whole
diagnosis, as the terminal prints it: each witness, its relative error against its tolerance, the
first wrong step, and the witness's detail line. A layer call a witness could not stand in
for is a ``<skipped>`` case, with the reason. Written with the standard library's
ElementTree, which escapes every text.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

from gradscope.report.models import (
    CheckedTensor,
    CheckReport,
    KerasCheckReport,
    LayerCheckReport,
)
from gradscope.report.tables import WITNESS_TITLES, failure_lines


def _layer(name: str) -> str:
    """The layer of a tensor name: ``gru_1/w_ru`` → ``gru_1``; the model's inputs (``x``,
    ``input NAME``) → ``inputs``; a layer's own backward (``layer NAME``, ``layer NAME[1]``)
    → its layer; another name without a layer (``loss``) → ``model``."""
    if name == "x" or name.startswith("input "):
        return "inputs"
    if name.startswith("layer "):
        return name[len("layer "):].split("[")[0]
    if "/" not in name:
        return "model"
    return name.split("/")[0].split("[")[0]


def _diagnosis(tensor: CheckedTensor) -> list[str]:
    lines = []
    for disagreement, detail in failure_lines(tensor):
        lines += [disagreement, *([f"    {detail}"] if detail else [])]
    return lines


def junit_xml(report: CheckReport | KerasCheckReport | LayerCheckReport, source: str) -> str:
    """The report as one JUnit XML document; ``source`` names what was checked (the model's
    file or config)."""
    tensors = report.tensors
    skipped = list(getattr(report, "not_witnessed", None) or [])
    failures = sum(not t.passed for t in tensors)
    unwitnessed = set(report.summary.unwitnessed_tensors)
    counts = {"tests": str(len(tensors) + len(skipped)), "failures": str(failures),
              "errors": "0", "skipped": str(len(skipped) + len(unwitnessed))}
    timings = report.timings or {}
    seconds = f"{sum(timings.values()):.3f}" if timings else "0"
    root = ET.Element("testsuites", {"name": "gradscope check", "time": seconds, **counts})
    suite = ET.SubElement(root, "testsuite", {"name": f"gradscope check {source}",
                                              "time": seconds, **counts})
    properties = ET.SubElement(suite, "properties")
    for name, tolerance in sorted(report.tolerances.items()):
        ET.SubElement(properties, "property", name=f"rtol.{name}", value=f"{tolerance:g}")
    dtype, reason = getattr(report, "dtype", None), getattr(report, "dtype_reason", None)
    if dtype is not None:
        ET.SubElement(properties, "property", name="dtype", value=dtype)
    if reason:
        ET.SubElement(properties, "property", name="dtype.reason", value=reason)
    examples = getattr(report, "examples", None)
    if examples is not None and examples.indices is not None:
        ET.SubElement(properties, "property", name="examples",
                      value=f"{examples.checked} of {examples.of}: "
                            + " ".join(str(i) for i in examples.indices))
    for tensor in tensors:
        case = ET.SubElement(suite, "testcase", classname=f"gradscope.check.{_layer(tensor.name)}",
                             name=tensor.name, time="0")
        if not tensor.passed:
            diagnosis = _diagnosis(tensor)
            failure = ET.SubElement(case, "failure", type="GradientMismatch",
                                    message=diagnosis[0] if diagnosis else "disagrees")
            failure.text = "\n".join(diagnosis)
        elif tensor.name in unwitnessed:
            # No witness compared it: skipped, not passed (found tried as a new user would).
            ET.SubElement(case, "skipped", message="no witness could compare it: every probe "
                                                   "at a kink, or the finite differences not "
                                                   "resolved")
        witnesses = ", ".join(sorted({WITNESS_TITLES[e.witness] for e in tensor.witnesses}))
        ET.SubElement(case, "system-out").text = f"witnesses: {witnesses}"
    for entry in skipped:
        case = ET.SubElement(suite, "testcase", classname=f"gradscope.check.{entry.layer}",
                             name=f"{entry.layer} · {entry.witness}", time="0")
        ET.SubElement(case, "skipped", message=entry.reason)
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"


def junit_error_xml(source: str, message: str, kind: str) -> str:
    """One ``<testcase>`` with an ``<error>``: check could not run (a usage or data error, an
    internal error), so that CI still finds the file it was told to read, and why."""
    counts = {"tests": "1", "failures": "0", "errors": "1", "skipped": "0"}
    root = ET.Element("testsuites", {"name": "gradscope check", "time": "0", **counts})
    suite = ET.SubElement(root, "testsuite", {"name": f"gradscope check {source}", "time": "0",
                                              **counts})
    case = ET.SubElement(suite, "testcase", classname="gradscope.check", name="check",
                         time="0")
    error = ET.SubElement(case, "error", type=kind, message=message.splitlines()[0])
    error.text = message
    ET.indent(root)
    return ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"
