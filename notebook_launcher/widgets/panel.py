"""``configure()``: choose this kernel's launch settings, in a panel or from code.

The panel shows the detected hardware and offers the number of processes, the precision
and the start method. What this machine cannot run is offered disabled, with the reason,
taken from the same rules the launcher checks (so a choice made here is never refused
at launch). A choice applies to every later ``notebook_launcher()`` call in this kernel
(explicit arguments still win); "Save as default" writes it to the defaults file that
the JupyterLab sidebar writes too, for new kernels.
"""

from __future__ import annotations

import html
from typing import Any

from notebook_launcher import defaults as launch_defaults
from notebook_launcher import gpu_guards, rules
from notebook_launcher.defaults import EffectiveDefaults, LaunchDefaults
from notebook_launcher.errors import DefaultsError
from notebook_launcher.hardware import HardwareReport
from notebook_launcher.hardware import detect as detect_hardware


class _Unset:
    def __repr__(self) -> str:
        return "<unchanged>"


UNSET: Any = _Unset()
AUTO = 0  # the dropdown's value for "let the launcher decide" (None would show as no choice)
PRECISION_LABELS = {"no": "no (fp32)", "fp16": "fp16", "bf16": "bf16", "fp8": "fp8"}
_SOURCE_WORDS = {
    launch_defaults.KERNEL: "chosen in this kernel",
    launch_defaults.FILE: "from the saved defaults",
}


def configure(
    num_processes: int | None = UNSET,
    mixed_precision: str | None = UNSET,
    start_method: str | None = UNSET,
    *,
    save: bool = False,
) -> LaunchDefaults | None:
    """Choose the launch settings of this kernel.

    Without arguments, shows a panel in the cell. With arguments, sets them from code
    (None: let the launcher decide) and returns the settings now in force; arguments not
    given keep their current value. ``save=True`` also writes them to the defaults file
    that new kernels and the JupyterLab sidebar read.
    """
    given = {
        key: value
        for key, value in (
            ("num_processes", num_processes),
            ("mixed_precision", mixed_precision),
            ("start_method", start_method),
        )
        if value is not UNSET
    }
    if not given and not save:
        from IPython.display import display

        display(ConfigurePanel(detect_hardware()).box)
        return None
    return apply_choice(given, detect_hardware(), save=save)


def apply_choice(
    given: dict[str, Any], report: HardwareReport, save: bool = False
) -> LaunchDefaults:
    """Check ``given`` against the rules and this machine, then make it this kernel's choice."""
    current = launch_defaults.kernel_defaults() or LaunchDefaults()
    try:
        # The launcher's own checks: what is accepted here is never refused at launch.
        chosen = launch_defaults.parse_defaults({**current.to_dict(), **given})
        launch_defaults.check_against_hardware(chosen, report)
    except DefaultsError as error:
        raise DefaultsError(f"configure() cannot use this setting: {error}") from error
    launch_defaults.set_kernel_defaults(chosen)
    effective = launch_defaults.effective_defaults().values
    if save:
        launch_defaults.save_defaults(effective)
    return effective


def hardware_html(report: HardwareReport) -> str:
    items = [f"<b>CPU</b>: {report.cpu_count} core{'s' if report.cpu_count != 1 else ''}"]
    usable = gpu_guards.usable_gpus(report.gpus) if report.gpus else {}
    for gpu in report.gpus:
        capability = (
            f", compute capability {gpu.compute_capability}" if gpu.compute_capability else ""
        )
        line = f"<b>GPU {gpu.index}</b>: {html.escape(gpu.name)}, {gpu.memory_mib / 1024:.0f} GiB{capability}"
        if not usable.get(gpu.index, True):
            # Greyed out: a launch on it is refused, with the fix, before any rank starts.
            line = (
                f'<span class="nl-gpu-unusable" style="opacity: 0.45;">{line}: the installed '
                "torch has no kernels for it</span>"
            )
        items.append(line)
    if report.tpu_cores:
        items.append(f"<b>TPU</b>: {report.tpu_cores} cores")
    if report.mps_available:
        items.append("<b>Apple MPS</b>: available")
    versions = f"Python {report.python_version}"
    if report.torch_version:
        versions += f", torch {report.torch_version}"
    if report.torch_xla_version:
        versions += f", torch_xla {report.torch_xla_version}"
    items.append(f"<b>Platform</b>: {html.escape(report.platform)}; {html.escape(versions)}")
    return "<br>".join(items)


class ConfigurePanel:
    """The widgets of ``configure()``; every change applies at once to this kernel."""

    def __init__(self, report: HardwareReport) -> None:
        import ipywidgets as w

        self._w = w
        self.report = report
        self.choices = rules.choices(report)  # the launcher's rules, never a copy of them
        effective = launch_defaults.effective_defaults()
        label = _label_layout(w)
        self.hardware = w.HTML(hardware_html(report))
        self.processes = w.Dropdown(
            options=self._process_options(),
            value=effective.values.num_processes or AUTO,
            layout=w.Layout(width="150px"),
        )
        self.precision_buttons = self._option_buttons("mixed_precision", PRECISION_LABELS)
        self.start_buttons = self._option_buttons(
            "start_method", {m: m for m in self.choices["start_method"]}
        )
        self.reasons = w.HTML(self._reasons_html())
        note = w.HTML(
            '<span style="opacity: 0.7; font-size: 12px; margin-left: 8px;">'
            f"{html.escape(self.choices['num_processes']['note'])}</span>"
        )
        self.summary = w.HTML()
        self.status = w.HTML()
        self.save_button = w.Button(
            description="Save as default", icon="save", tooltip=str(launch_defaults.defaults_path())
        )
        self.reset_button = w.Button(
            description="Reset", icon="undo", tooltip="Forget this kernel's choices"
        )
        self.save_button.on_click(lambda _: self._save())
        self.reset_button.on_click(lambda _: self._reset())
        self._resetting = False
        self.processes.observe(self._on_processes, names="value")
        self.box = w.VBox(
            [
                w.HTML("<b>notebook_launcher</b> &nbsp;launch settings for this kernel"),
                self.hardware,
                w.HBox([w.Label("Processes", layout=label), self.processes, note]),
                w.HBox([w.Label("Precision", layout=label), *self.precision_buttons.values()]),
                w.HBox([w.Label("Start method", layout=label), *self.start_buttons.values()]),
                self.reasons,
                self.summary,
                w.HBox([self.save_button, self.reset_button, self.status]),
            ],
            layout=w.Layout(border="1px solid rgba(128, 128, 128, 0.35)", padding="6px 10px"),
        )
        self.box.add_class("notebook-launcher-configure")
        self._show(effective)

    def _process_options(self) -> list[tuple[str, int]]:
        limit = self.choices["num_processes"]["max"]
        default = self.choices["num_processes"]["default"]
        options = [(f"auto ({default})", AUTO)]
        return options + [
            (str(n), n) for n in range(self.choices["num_processes"]["min"], limit + 1)
        ]

    def _option_buttons(self, key: str, labels: dict[str, str]) -> dict[str, Any]:
        w = self._w
        buttons = {}
        for value, reason in self.choices[key].items():
            button = w.Button(
                description=labels.get(value, value),
                disabled=reason is not None,
                tooltip=reason or f"{key}={value!r}",
                layout=w.Layout(width="auto", margin="2px 4px 2px 0"),
            )
            button.on_click(lambda _, key=key, value=value: self._choose(key, value))
            buttons[value] = button
        return buttons

    def _reasons_html(self) -> str:
        items = [
            f"<li><b>{html.escape(value)}</b> is unavailable: {html.escape(reason)}</li>"
            for key in ("mixed_precision", "start_method")
            for value, reason in self.choices[key].items()
            if reason is not None
        ]
        if not items:
            return ""
        return f'<ul style="margin: 2px 0; padding-left: 18px; opacity: 0.8; font-size: 12px;">{"".join(items)}</ul>'

    def _choose(self, key: str, value: Any) -> None:
        try:
            apply_choice({key: value}, self.report)
        except DefaultsError as error:
            self.status.value = f'<span style="color: #d62728;">{html.escape(str(error))}</span>'
            return
        self.status.value = ""
        self._show(launch_defaults.effective_defaults())

    def _on_processes(self, change: dict[str, Any]) -> None:
        if not self._resetting:
            self._choose("num_processes", change["new"] or None)

    def _save(self) -> None:
        effective = launch_defaults.effective_defaults().values
        try:
            path = launch_defaults.save_defaults(effective)
        except OSError as error:
            self.status.value = (
                f'<span style="color: #d62728;">Could not save to {html.escape(str(launch_defaults.defaults_path()))}: '
                f"{html.escape(error.strerror or str(error))}</span>"
            )
            return
        self.status.value = f"Saved to {html.escape(str(path))}: new kernels use it too."

    def _reset(self) -> None:
        launch_defaults.set_kernel_defaults(None)
        effective = launch_defaults.effective_defaults()
        self._resetting = True  # showing the file's value is not a choice of this kernel
        try:
            self.processes.value = effective.values.num_processes or AUTO
        finally:
            self._resetting = False
        self.status.value = "This kernel's choices are forgotten."
        self._show(effective)

    def _show(self, effective: EffectiveDefaults) -> None:
        values = effective.values
        precision = values.mixed_precision or "no"
        method = values.start_method or "auto"
        for value, button in self.precision_buttons.items():
            button.button_style = "primary" if value == precision else ""
        for value, button in self.start_buttons.items():
            button.button_style = "primary" if value == method else ""
        description = launch_defaults.describe_launch(values, self.report)
        sources = "; ".join(
            f"{field} {_SOURCE_WORDS.get(source, source)}"
            for field, source in sorted(effective.sources.items())
        )
        self.summary.value = (
            f"Next <code>notebook_launcher()</code> call: <b>{html.escape(description)}</b>"
            + (
                f'<br><span style="opacity: 0.7; font-size: 12px;">{html.escape(sources)}</span>'
                if sources
                else ""
            )
        )


def _label_layout(w: Any) -> Any:
    return w.Layout(width="110px")
