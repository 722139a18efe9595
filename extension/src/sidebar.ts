import { LabIcon } from '@jupyterlab/ui-components';
import { Message } from '@lumino/messaging';
import { Poll } from '@lumino/polling';
import { Panel } from '@lumino/widgets';

import { errorMessage, getDefaults, getHardware, getLaunches } from './api';
import { DefaultsWidget } from './defaultsForm';
import { HardwareWidget } from './hardware';
import { LaunchesWidget } from './launches';

const LAUNCHES_INTERVAL_MS = 2000;

/**
 * The "Distributed" sidebar: hardware, launch defaults and the launches running now.
 */
export class DistributedSidebar extends Panel {
  constructor(icon: LabIcon) {
    super();
    this.id = 'notebook-launcher-sidebar';
    this.addClass('jp-NotebookLauncher');
    this.title.icon = icon;
    this.title.caption = 'Distributed';
    this.title.label = '';
    this.addWidget(this._hardware);
    this.addWidget(this._defaults);
    this.addWidget(this._launches);
    this._launches.onRequested = () => {
      void this._poll.refresh();
    };
    this._poll = new Poll({
      factory: () => this._refreshLaunches(),
      frequency: {
        interval: LAUNCHES_INTERVAL_MS,
        backoff: true,
        max: 30 * 1000
      },
      name: 'notebook-launcher:launches',
      standby: () => this.isHidden || 'when-hidden'
    });
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._poll.dispose();
    super.dispose();
  }

  /** Read the hardware and the saved defaults again. */
  async refresh(): Promise<void> {
    try {
      const { hardware, choices } = await getHardware();
      this._hardware.showReport(hardware);
      this._defaults.setChoices(choices);
    } catch (error) {
      this._hardware.showError(errorMessage(error));
      this._defaults.showError(
        `Cannot offer choices without the hardware: ${errorMessage(error)}`
      );
      return;
    }
    try {
      this._defaults.showSaved(await getDefaults());
    } catch (error) {
      this._defaults.showError(
        `Could not read the saved defaults: ${errorMessage(error)}`
      );
    }
  }

  protected onAfterShow(msg: Message): void {
    super.onAfterShow(msg);
    if (!this._loaded) {
      this._loaded = true;
      this.refresh().catch((error: unknown) => {
        this._hardware.showError(errorMessage(error));
      });
    }
    void this._poll.refresh();
  }

  private async _refreshLaunches(): Promise<void> {
    try {
      this._launches.showLaunches(await getLaunches());
    } catch (error) {
      this._launches.showError(errorMessage(error));
      throw error; // the poll then backs off
    }
    if (this._loaded) {
      // The defaults file may have been written by configure(..., save=True) meanwhile.
      try {
        this._defaults.followSaved(await getDefaults());
      } catch {
        // shown at the next full refresh; the launches above are still current
      }
    }
  }

  private _loaded = false;
  private _poll: Poll;
  private _hardware = new HardwareWidget();
  private _defaults = new DefaultsWidget();
  private _launches = new LaunchesWidget();
}
