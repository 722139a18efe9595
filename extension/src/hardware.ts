import { Widget } from '@lumino/widgets';

import { IHardwareReport } from './api';
import { h, setStatus } from './dom';

const ACCELERATOR_WORDS: Record<string, string> = {
  cuda: 'CUDA GPUs',
  tpu: 'TPU cores',
  mps: 'Apple MPS',
  cpu: 'CPU processes'
};

/**
 * The machine's hardware as the server detected it (without initialising CUDA).
 */
export class HardwareWidget extends Widget {
  constructor() {
    super();
    this.addClass('jp-NotebookLauncher-hardware');
    this.node.append(
      h('h3', { className: 'jp-NotebookLauncher-heading', text: 'Hardware' }),
      this._list,
      this._status
    );
    setStatus(this._status, 'Detecting hardware…');
  }

  showReport(report: IHardwareReport): void {
    setStatus(this._status, '');
    const rows: [string, string][] = [
      [
        'Ranks run on',
        ACCELERATOR_WORDS[report.accelerator] ?? report.accelerator
      ],
      ['CPU cores', String(report.cpu_count)]
    ];
    report.gpus.forEach(gpu => {
      const gib = (gpu.memory_mib / 1024).toFixed(1);
      rows.push([`GPU ${gpu.index}`, `${gpu.name}, ${gib} GiB`]);
    });
    if (report.tpu_summary) {
      rows.push(['TPU', report.tpu_summary]);
    }
    if (report.mps_available) {
      rows.push(['Apple MPS', 'available']);
    }
    rows.push(['Python', report.python_version]);
    rows.push(['torch', report.torch_version ?? 'not installed']);
    if (report.torch_xla_version) {
      rows.push(['torch_xla', report.torch_xla_version]);
    }
    if (report.driver_version) {
      rows.push(['NVIDIA driver', report.driver_version]);
    }
    if (report.platform !== 'local') {
      rows.push(['Platform', report.platform]);
    }
    this._list.replaceChildren(
      ...rows.flatMap(([name, value]) => [
        h('dt', { text: name }),
        h('dd', { text: value })
      ])
    );
  }

  showError(message: string): void {
    this._list.replaceChildren();
    setStatus(this._status, `Could not read the hardware: ${message}`, 'error');
  }

  private _list = h('dl', { className: 'jp-NotebookLauncher-facts' });
  private _status = h('p', { className: 'jp-NotebookLauncher-status' });
}
