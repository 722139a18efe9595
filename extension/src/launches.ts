import { Widget } from '@lumino/widgets';

import {
  askWhere,
  errorMessage,
  ILaunchesReply,
  ILaunchInfo,
  stopLaunch
} from './api';
import { h, setStatus } from './dom';

/** "42 s", "3 min 5 s", "2 h 10 min" */
export function formatDuration(seconds: number): string {
  const s = Math.max(0, Math.floor(seconds));
  if (s < 60) {
    return `${s} s`;
  }
  if (s < 3600) {
    return `${Math.floor(s / 60)} min ${s % 60} s`;
  }
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

// A "where?" the session has not answered after this many listings may be asked again.
const WHERE_LISTINGS = 5;

/**
 * The launches running now on this server, each with a stop button; a session also says,
 * when asked, where each of its ranks is.
 */
export class LaunchesWidget extends Widget {
  /** Called after a stop or a "where?" was requested, so the owner can refresh at once. */
  onRequested: () => void = () => undefined;

  constructor() {
    super();
    this.addClass('jp-NotebookLauncher-launches');
    this.node.append(
      h('h3', {
        className: 'jp-NotebookLauncher-heading',
        text: 'Running launches'
      }),
      this._list,
      this._listStatus,
      this._stopStatus
    );
    setStatus(this._listStatus, '');
    setStatus(this._stopStatus, '');
  }

  showLaunches(reply: ILaunchesReply): void {
    setStatus(this._listStatus, '');
    const running = new Set(reply.launches.map(launch => launch.launch_id));
    for (const id of this._stopRequested) {
      if (!running.has(id)) {
        this._stopRequested.delete(id);
      }
    }
    for (const launch of reply.launches) {
      const asked = this._whereAsked.get(launch.launch_id);
      if (asked === undefined) {
        continue;
      }
      asked.listings += 1;
      if (
        (launch.where_at ?? null) !== asked.answeredAt ||
        asked.listings > WHERE_LISTINGS
      ) {
        this._whereAsked.delete(launch.launch_id);
      }
    }
    for (const id of this._whereAsked.keys()) {
      if (!running.has(id)) {
        this._whereAsked.delete(id);
      }
    }
    if (reply.launches.length === 0) {
      this._list.replaceChildren(
        h('li', {
          className: 'jp-NotebookLauncher-empty',
          text: 'No launch is running.'
        })
      );
      return;
    }
    this._list.replaceChildren(
      ...reply.launches.map(launch => this._row(launch, reply.now))
    );
  }

  showError(message: string): void {
    setStatus(
      this._listStatus,
      `Could not list the launches: ${message}`,
      'error'
    );
  }

  private _row(launch: ILaunchInfo, now: number): HTMLElement {
    const where =
      launch.notebook ??
      (launch.kernel_id
        ? `kernel ${launch.kernel_id.slice(0, 8)}`
        : `process ${launch.kernel_pid}`);
    const started = new Date(launch.started_at * 1000).toLocaleTimeString();
    const stopping =
      launch.state === 'stopping' || this._stopRequested.has(launch.launch_id);
    const stop = h('button', {
      className: 'jp-mod-styled jp-mod-warn jp-NotebookLauncher-stop',
      text: stopping ? 'Stopping…' : 'Stop',
      attrs: { type: 'button', 'aria-label': `Stop launch ${launch.launch_id}` }
    });
    stop.disabled = stopping;
    stop.addEventListener('click', () => {
      setStatus(this._stopStatus, '');
      stop.disabled = true;
      stop.textContent = 'Stopping…';
      this._stopRequested.add(launch.launch_id);
      stopLaunch(launch.launch_id)
        .then(() => this.onRequested())
        .catch((error: unknown) => {
          this._stopRequested.delete(launch.launch_id);
          stop.disabled = false;
          stop.textContent = 'Stop';
          setStatus(
            this._stopStatus,
            `Could not stop the launch: ${errorMessage(error)}`,
            'error'
          );
        });
    });
    const device =
      launch.accelerator === 'cuda' ? 'GPU' : launch.accelerator.toUpperCase();
    const isSession = launch.kind === 'session';
    const what = isSession ? 'Session: ' : '';
    return h(
      'li',
      {
        className: 'jp-NotebookLauncher-launch',
        attrs: { 'data-launch-id': launch.launch_id }
      },
      [
        h('div', {
          className: 'jp-NotebookLauncher-launch-where',
          text: where,
          attrs: { title: where }
        }),
        h('div', {
          className: 'jp-NotebookLauncher-launch-what',
          text: `${what}${launch.num_processes} x ${device} rank${launch.num_processes === 1 ? '' : 's'}, ${launch.mixed_precision}, ${launch.start_method}`
        }),
        h('div', {
          className: 'jp-NotebookLauncher-launch-state',
          text: `${launch.state} since ${started} (${formatDuration(now - launch.started_at)})`
        }),
        ...(isSession ? this._where(launch, now) : []),
        stop
      ]
    );
  }

  /** A session's "Where?" button, and its last answer: one line per rank. */
  private _where(launch: ILaunchInfo, now: number): HTMLElement[] {
    const asking = this._whereAsked.has(launch.launch_id);
    const button = h('button', {
      className: 'jp-mod-styled jp-NotebookLauncher-where',
      text: asking ? 'Asking…' : 'Where are the ranks?',
      attrs: {
        type: 'button',
        'aria-label': `Where are the ranks of session ${launch.launch_id}?`
      }
    });
    button.disabled = asking;
    button.addEventListener('click', () => {
      setStatus(this._stopStatus, '');
      button.disabled = true;
      button.textContent = 'Asking…';
      this._whereAsked.set(launch.launch_id, {
        answeredAt: launch.where_at ?? null,
        listings: 0
      });
      askWhere(launch.launch_id)
        .then(() => this.onRequested())
        .catch((error: unknown) => {
          this._whereAsked.delete(launch.launch_id);
          button.disabled = false;
          button.textContent = 'Where are the ranks?';
          setStatus(
            this._stopStatus,
            `Could not ask the session: ${errorMessage(error)}`,
            'error'
          );
        });
    });
    const shown: HTMLElement[] = [button];
    if (launch.where_at && launch.where?.length) {
      // Plain text: a cell's own words (a function's name) never become markup.
      shown.push(
        h(
          'ul',
          {
            className: 'jp-NotebookLauncher-launch-ranks',
            attrs: {
              'aria-label': `Where the ranks were ${formatDuration(now - launch.where_at)} ago`
            }
          },
          launch.where.map(line => h('li', { text: line }))
        ),
        h('div', {
          className: 'jp-NotebookLauncher-launch-where-age',
          text: `as of ${formatDuration(now - launch.where_at)} ago`
        })
      );
    }
    return shown;
  }

  private _stopRequested = new Set<string>();
  private _whereAsked = new Map<
    string,
    { answeredAt: number | null; listings: number }
  >();
  private _list = h('ul', { className: 'jp-NotebookLauncher-launch-list' });
  private _listStatus = h('p', { className: 'jp-NotebookLauncher-status' });
  private _stopStatus = h('p', { className: 'jp-NotebookLauncher-status' });
}
