"""REST endpoints under ``/notebook-launcher/``; every one needs Jupyter's authentication.

GET  hardware                  the machine's hardware report and what a panel may offer
GET  defaults                  the saved launch defaults and what a launch will now do
POST defaults                  replace the saved defaults (validated against the hardware)
GET  launches                  the launches running now, with their notebooks
POST launches/<launch_id>/stop ask one launch to stop its ranks
POST launches/<launch_id>/where ask a session where its ranks are (its record then says)

The reply shapes are the TypedDicts below; extension/src/api.ts mirrors them.
"""

from __future__ import annotations

import asyncio
import json
import time
import warnings
from typing import Any, TypedDict

import tornado.web
from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join

from notebook_launcher import defaults as launch_defaults
from notebook_launcher import hardware, registry, rules

AUTH_RESOURCE = "notebook_launcher"


class GpuInfoJSON(TypedDict):
    index: int
    name: str
    memory_mib: int
    compute_capability: str


class TpuInfoJSON(TypedDict):  # notebook_launcher.tpu.TpuInfo
    generation: str
    accelerator_type: str
    chips: int
    cores_per_chip: int
    processes: int
    hosts: int
    pjrt_device: str
    libtpu_version: str | None
    evidence: list[str]


class HardwareReportJSON(TypedDict):  # HardwareReport.to_dict()
    cpu_count: int
    gpus: list[GpuInfoJSON]
    driver_version: str | None
    tpu_cores: int
    mps_available: bool
    platform: str
    python_version: str
    torch_version: str | None
    torch_xla_version: str | None
    tpu: TpuInfoJSON | None
    tpu_summary: str | None
    accelerator: str
    default_num_processes: int
    max_num_processes: int
    precisions: dict[str, str | None]


class NumProcessesChoice(TypedDict):
    min: int
    max: int
    default: int
    note: str


class ChoicesJSON(TypedDict):  # notebook_launcher.rules.choices()
    num_processes: NumProcessesChoice
    mixed_precision: dict[str, str | None]
    start_method: dict[str, str | None]


class HardwareReply(TypedDict):
    hardware: HardwareReportJSON
    choices: ChoicesJSON


class LaunchDefaultsJSON(TypedDict):  # LaunchDefaults.to_dict()
    num_processes: int | None
    mixed_precision: str | None
    start_method: str | None


class DefaultsReply(TypedDict):
    defaults: LaunchDefaultsJSON
    path: str
    description: str  # what notebook_launcher() with no arguments will now do
    problem: str | None  # why a saved file was ignored, if it was


class LaunchInfo(TypedDict):
    launch_id: str
    kernel_id: str | None
    kernel_pid: int
    notebook: str | None  # the notebook's path relative to the server root, when known
    num_processes: int
    accelerator: str
    mixed_precision: str
    start_method: str
    state: str
    started_at: float
    rank_pids: list[int]
    kind: str  # "launch", or "session" (ranks kept across cells)
    where: list[str]  # a session's ranks, one line each, when last asked (see WhereHandler)
    where_at: float | None


class LaunchesReply(TypedDict):
    launches: list[LaunchInfo]
    now: float  # the server's clock, so "running for" does not depend on the browser's


class ErrorReply(TypedDict):
    message: str


async def _hardware_report() -> hardware.HardwareReport:
    # The first detection runs nvidia-smi (up to seconds); keep it off the event loop.
    return await asyncio.get_running_loop().run_in_executor(None, hardware.detect)


class _Handler(APIHandler):
    auth_resource = AUTH_RESOURCE

    def _reply(self, body: Any, status: int = 200) -> None:
        self.set_status(status)
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps(body))

    def _refuse(self, status: int, message: str) -> None:
        # Not HTTPError: its message goes through %-formatting and the status line.
        self._reply(ErrorReply(message=message), status)


class HardwareHandler(_Handler):
    @tornado.web.authenticated
    @authorized
    async def get(self) -> None:
        report = await _hardware_report()
        self._reply(
            HardwareReply(
                hardware=report.to_dict(),  # type: ignore[typeddict-item]
                choices=rules.choices(report),  # type: ignore[typeddict-item]
            )
        )


class DefaultsHandler(_Handler):
    @tornado.web.authenticated
    @authorized
    async def get(self) -> None:
        report = await _hardware_report()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", launch_defaults.DefaultsFileWarning)
            saved = launch_defaults.load_defaults()
        problems = [
            str(w.message)
            for w in caught
            if issubclass(w.category, launch_defaults.DefaultsFileWarning)
        ]
        self._reply(self._defaults_reply(saved, report, problems[0] if problems else None))

    @tornado.web.authenticated
    @authorized
    async def post(self) -> None:
        try:
            body = json.loads(self.request.body or b"null")
        except RecursionError:
            self._refuse(
                400,
                "The request body is JSON nested too deeply to be launch defaults; send an "
                'object such as {"num_processes": 2}.',
            )
            return
        except ValueError as e:
            self._refuse(
                400,
                f'The request body is not JSON ({e}); send an object such as {{"num_processes": 2}}.',
            )
            return
        report = await _hardware_report()
        try:
            chosen = launch_defaults.parse_defaults(body)
            launch_defaults.check_against_hardware(chosen, report)
        except launch_defaults.DefaultsError as e:
            self._refuse(400, str(e))
            return
        try:
            launch_defaults.save_defaults(chosen)
        except OSError as e:
            path = launch_defaults.defaults_path()
            self._refuse(
                500,
                f"Could not save the launch defaults to {path}: {e.strerror or e}. Check that the directory is writable.",
            )
            return
        self._reply(self._defaults_reply(chosen, report, None))

    @staticmethod
    def _defaults_reply(
        saved: launch_defaults.LaunchDefaults, report: hardware.HardwareReport, problem: str | None
    ) -> DefaultsReply:
        return DefaultsReply(
            defaults=saved.to_dict(),  # type: ignore[typeddict-item]
            path=str(launch_defaults.defaults_path()),
            description=launch_defaults.describe_launch(saved, report),
            problem=problem,
        )


class LaunchesHandler(_Handler):
    @tornado.web.authenticated
    @authorized
    async def get(self) -> None:
        notebooks = await self._notebooks_by_kernel()
        launches = [
            LaunchInfo(
                launch_id=r.launch_id,
                kernel_id=r.kernel_id,
                kernel_pid=r.kernel_pid,
                notebook=notebooks.get(r.kernel_id) if r.kernel_id else None,
                num_processes=r.num_processes,
                accelerator=r.accelerator,
                mixed_precision=r.mixed_precision,
                start_method=r.start_method,
                state=r.state,
                started_at=r.started_at,
                rank_pids=list(r.rank_pids),
                kind=r.kind,
                where=list(r.where),
                where_at=r.where_at,
            )
            for r in registry.list_launches()
        ]
        self._reply(LaunchesReply(launches=launches, now=time.time()))

    async def _notebooks_by_kernel(self) -> dict[str, str]:
        manager = self.settings.get("session_manager")
        if manager is None:
            return {}
        try:
            sessions = await manager.list_sessions()
        except Exception as e:  # the list of launches is still worth showing without names
            self.log.warning("notebook_launcher: could not list sessions: %s", e)
            return {}
        return {s["kernel"]["id"]: s["path"] for s in sessions if s.get("kernel")}


class StopHandler(_Handler):
    @tornado.web.authenticated
    @authorized
    async def post(self, launch_id: str) -> None:
        if not registry.request_stop(launch_id):
            self._refuse(
                404,
                f"No running launch has the id {launch_id!r}; it may have finished already. "
                f"The list of launches shows the ones running now.",
            )
            return
        self._reply({"launch_id": launch_id, "stop_requested": True}, 202)


class WhereHandler(_Handler):
    @tornado.web.authenticated
    @authorized
    async def post(self, launch_id: str) -> None:
        if not registry.request_where(launch_id):
            self._refuse(
                404,
                f"No running session has the id {launch_id!r}: only a session's ranks can say "
                "where they are, and it may have ended. The list of launches shows the ones "
                "running now.",
            )
            return
        self._reply({"launch_id": launch_id, "where_requested": True}, 202)


def setup_handlers(web_app: tornado.web.Application) -> None:
    base = url_path_join(web_app.settings["base_url"], "notebook-launcher")
    web_app.add_handlers(
        ".*$",
        [
            (url_path_join(base, "hardware"), HardwareHandler),
            (url_path_join(base, "defaults"), DefaultsHandler),
            (url_path_join(base, "launches"), LaunchesHandler),
            (url_path_join(base, "launches", r"(?P<launch_id>[^/]+)", "stop"), StopHandler),
            (url_path_join(base, "launches", r"(?P<launch_id>[^/]+)", "where"), WhereHandler),
        ],
    )
