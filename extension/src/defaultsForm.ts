import { Widget } from '@lumino/widgets';

import {
  errorMessage,
  IChoices,
  IDefaultsReply,
  ILaunchDefaults,
  saveDefaults,
  Support
} from './api';
import { h, setStatus } from './dom';

const AUTO = '';

const PRECISION_LABELS: Record<string, string> = {
  no: 'fp32 (no mixed precision)',
  fp16: 'fp16',
  bf16: 'bf16',
  fp8: 'fp8'
};

const START_METHOD_LABELS: Record<string, string> = {
  auto: 'auto (fastest safe one)',
  fork: 'fork',
  forkserver: 'forkserver',
  spawn: 'spawn'
};

/**
 * The same choices as the notebook's configure() panel, saved as the user's defaults.
 */
export class DefaultsWidget extends Widget {
  constructor() {
    super();
    this.addClass('jp-NotebookLauncher-defaults');
    this._save.addEventListener('click', () => {
      void this._onSave();
    });
    for (const select of [this._processes, this._precision, this._method]) {
      select.addEventListener('change', () => {
        this._edited = true;
        setStatus(this._status, 'Not saved yet.');
      });
    }
    this.node.append(
      h('h3', {
        className: 'jp-NotebookLauncher-heading',
        text: 'Launch defaults'
      }),
      this._field('Processes', this._processes, this._processesNote),
      this._field('Mixed precision', this._precision, this._precisionNotes),
      this._field('Start method', this._method, this._methodNotes),
      h('div', { className: 'jp-NotebookLauncher-actions' }, [this._save]),
      this._status,
      this._problem,
      h('p', {
        className: 'jp-NotebookLauncher-label',
        text: 'notebook_launcher() will run:'
      }),
      this._description,
      this._path
    );
    this._save.disabled = true;
    setStatus(this._status, '');
    setStatus(this._problem, '');
  }

  /** Fill the options from what the machine supports. */
  setChoices(choices: IChoices): void {
    const limits = choices.num_processes;
    const max = limits.max;
    this._processes.replaceChildren(
      h('option', {
        text: `auto (${limits.default})`,
        attrs: { value: AUTO }
      })
    );
    for (let n = limits.min; n <= max; n++) {
      this._processes.append(
        h('option', { text: String(n), attrs: { value: String(n) } })
      );
    }
    this._processesNote.textContent = limits.note;
    this._fillSupport(
      this._precision,
      this._precisionNotes,
      choices.mixed_precision,
      PRECISION_LABELS
    );
    this._fillSupport(
      this._method,
      this._methodNotes,
      choices.start_method,
      START_METHOD_LABELS
    );
    this._save.disabled = false;
    if (this._saved) {
      this._select(this._saved);
    }
  }

  /**
   * Follow the saved file when something else changed it (configure(..., save=True) in a
   * notebook, another browser tab); a choice the user is still editing is left alone.
   */
  followSaved(reply: IDefaultsReply): void {
    if (JSON.stringify(reply.defaults) === JSON.stringify(this._saved)) {
      return;
    }
    if (this._edited) {
      setStatus(
        this._status,
        'The saved defaults changed elsewhere; save to keep the choice shown here.',
        'warning'
      );
      return;
    }
    this.showSaved(reply);
    setStatus(this._status, 'Updated: the saved defaults changed.');
  }

  /** Show what is saved now. */
  showSaved(reply: IDefaultsReply): void {
    this._edited = false;
    this._saved = reply.defaults;
    this._select(reply.defaults);
    this._description.textContent = reply.description;
    this._path.textContent = `Saved in ${reply.path}`;
    setStatus(this._problem, reply.problem ?? '', 'warning');
  }

  showError(message: string): void {
    setStatus(this._status, message, 'error');
  }

  private _field(
    label: string,
    control: HTMLSelectElement,
    note: HTMLElement
  ): HTMLElement {
    control.setAttribute('aria-label', label);
    return h('label', { className: 'jp-NotebookLauncher-field' }, [
      h('span', { className: 'jp-NotebookLauncher-label', text: label }),
      control,
      note
    ]);
  }

  private _fillSupport(
    select: HTMLSelectElement,
    notes: HTMLElement,
    support: Support,
    labels: Record<string, string>
  ): void {
    select.replaceChildren(
      h('option', { text: 'auto', attrs: { value: AUTO } })
    );
    notes.replaceChildren();
    for (const [value, reason] of Object.entries(support)) {
      if (value === 'auto') {
        continue; // the first option already stands for it
      }
      const option = h('option', {
        text: labels[value] ?? value,
        attrs: { value }
      });
      if (reason !== null) {
        option.disabled = true;
        option.title = reason;
        notes.append(h('li', { text: `${value}: ${reason}` }));
      }
      select.append(option);
    }
  }

  private _select(defaults: ILaunchDefaults): void {
    const processes =
      defaults.num_processes === null ? AUTO : String(defaults.num_processes);
    if (
      ![...this._processes.options].some(option => option.value === processes)
    ) {
      // Saved by hand or on another machine: still show it rather than a blank choice.
      this._processes.append(
        h('option', { text: processes, attrs: { value: processes } })
      );
    }
    this._processes.value = processes;
    this._precision.value = defaults.mixed_precision ?? AUTO;
    this._method.value =
      defaults.start_method === null || defaults.start_method === 'auto'
        ? AUTO
        : defaults.start_method;
  }

  private _chosen(): ILaunchDefaults {
    return {
      num_processes:
        this._processes.value === AUTO ? null : Number(this._processes.value),
      mixed_precision:
        this._precision.value === AUTO ? null : this._precision.value,
      start_method: this._method.value === AUTO ? null : this._method.value
    };
  }

  private async _onSave(): Promise<void> {
    this._save.disabled = true;
    setStatus(this._status, 'Saving…');
    try {
      const reply = await saveDefaults(this._chosen());
      this.showSaved(reply);
      setStatus(this._status, 'Saved.');
    } catch (error) {
      setStatus(this._status, `Not saved: ${errorMessage(error)}`, 'error');
    } finally {
      this._save.disabled = false;
    }
  }

  private _saved: ILaunchDefaults | null = null;
  private _edited = false;
  private _processes = h('select', { className: 'jp-mod-styled' });
  private _processesNote = h('span', { className: 'jp-NotebookLauncher-note' });
  private _precision = h('select', { className: 'jp-mod-styled' });
  private _precisionNotes = h('ul', { className: 'jp-NotebookLauncher-note' });
  private _method = h('select', { className: 'jp-mod-styled' });
  private _methodNotes = h('ul', { className: 'jp-NotebookLauncher-note' });
  private _save = h('button', {
    className: 'jp-mod-styled jp-mod-accept',
    text: 'Save defaults',
    attrs: { type: 'button' }
  });
  private _status = h('p', { className: 'jp-NotebookLauncher-status' });
  private _problem = h('p', { className: 'jp-NotebookLauncher-status' });
  private _description = h('p', {
    className: 'jp-NotebookLauncher-description'
  });
  private _path = h('p', { className: 'jp-NotebookLauncher-note' });
}
