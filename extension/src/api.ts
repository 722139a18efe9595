/**
 * Typed calls to the server extension under `/notebook-launcher/`.
 *
 * The reply shapes mirror the TypedDicts in notebook_launcher/server/handlers.py;
 * tests/test_api_types.py fails when the two disagree.
 */
import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

/** Each option mapped to null when the machine can run it, else the reason it cannot. */
export type Support = Record<string, string | null>;

export interface IGpuInfo {
  index: number;
  name: string;
  memory_mib: number;
  compute_capability: string;
}

export interface ITpuInfo {
  generation: string;
  accelerator_type: string;
  chips: number;
  cores_per_chip: number;
  processes: number;
  hosts: number;
  pjrt_device: string;
  libtpu_version: string | null;
  evidence: string[];
}

export interface IHardwareReport {
  cpu_count: number;
  gpus: IGpuInfo[];
  driver_version: string | null;
  tpu_cores: number;
  mps_available: boolean;
  platform: string;
  python_version: string;
  torch_version: string | null;
  torch_xla_version: string | null;
  /** The TPU (or XLA on the CPU); notebook_launcher/tpu.py's TpuInfo. */
  tpu: ITpuInfo | null;
  /** One line: "TPU v5litepod-8: 8 chip(s), 8 core(s), 8 process(es)". */
  tpu_summary: string | null;
  accelerator: string;
  default_num_processes: number;
  max_num_processes: number;
  precisions: Support;
}

export interface INumProcessesChoice {
  min: number;
  max: number;
  default: number;
  note: string;
}

export interface IChoices {
  num_processes: INumProcessesChoice;
  mixed_precision: Support;
  start_method: Support;
}

export interface IHardwareReply {
  hardware: IHardwareReport;
  choices: IChoices;
}

export interface ILaunchDefaults {
  num_processes: number | null;
  mixed_precision: string | null;
  start_method: string | null;
}

export interface IDefaultsReply {
  defaults: ILaunchDefaults;
  path: string;
  description: string;
  problem: string | null;
}

export interface ILaunchInfo {
  launch_id: string;
  kernel_id: string | null;
  kernel_pid: number;
  notebook: string | null;
  num_processes: number;
  accelerator: string;
  mixed_precision: string;
  start_method: string;
  state: string;
  started_at: number;
  rank_pids: number[];
  /** "launch", or "session": ranks kept across cells (%distributed) */
  kind?: string;
  /** A session's answer to "where?": one line per rank, and when it was made. */
  where?: string[];
  where_at?: number | null;
}

export interface ILaunchesReply {
  launches: ILaunchInfo[];
  now: number;
}

/**
 * An error the user should read: the server's own message where it gave one.
 */
export class ApiError extends Error {
  constructor(
    message: string,
    readonly status: number | null
  ) {
    super(message);
    this.name = 'ApiError';
  }
}

async function request<T>(
  endPoint: string,
  init: RequestInit = {}
): Promise<T> {
  const settings = ServerConnection.makeSettings();
  const url = URLExt.join(settings.baseUrl, 'notebook-launcher', endPoint);
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new ApiError(
      `Could not reach the Jupyter server (${String(error)}); check that it is still running.`,
      null
    );
  }
  const text = await response.text();
  let body: unknown = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch {
    body = null;
  }
  if (!response.ok) {
    const message =
      body !== null &&
      typeof body === 'object' &&
      typeof (body as { message?: unknown }).message === 'string'
        ? (body as { message: string }).message
        : `${endPoint}: the server answered ${response.status} ${response.statusText}.`;
    throw new ApiError(message, response.status);
  }
  return body as T;
}

export function getHardware(): Promise<IHardwareReply> {
  return request<IHardwareReply>('hardware');
}

export function getDefaults(): Promise<IDefaultsReply> {
  return request<IDefaultsReply>('defaults');
}

export function saveDefaults(
  defaults: ILaunchDefaults
): Promise<IDefaultsReply> {
  return request<IDefaultsReply>('defaults', {
    method: 'POST',
    body: JSON.stringify(defaults)
  });
}

export function getLaunches(): Promise<ILaunchesReply> {
  return request<ILaunchesReply>('launches');
}

export function stopLaunch(launchId: string): Promise<unknown> {
  return request<unknown>(
    URLExt.join('launches', encodeURIComponent(launchId), 'stop'),
    { method: 'POST', body: '{}' }
  );
}

/** Ask a session where its ranks are; its record in the list says so soon after. */
export function askWhere(launchId: string): Promise<unknown> {
  return request<unknown>(
    URLExt.join('launches', encodeURIComponent(launchId), 'where'),
    { method: 'POST', body: '{}' }
  );
}

/** The text to show for any error a call may end with. */
export function errorMessage(error: unknown): string {
  return error instanceof Error ? error.message : String(error);
}
