import {
  ILabShell,
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette } from '@jupyterlab/apputils';

import { distributedIcon } from './icon';
import { DistributedSidebar } from './sidebar';

namespace CommandIDs {
  export const open = 'notebook-launcher:open-sidebar';
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'notebook-launcher-labextension:plugin',
  description:
    'A "Distributed" sidebar: hardware, launch defaults and running launches of notebook_launcher.',
  autoStart: true,
  // Optional: Notebook 7 has no lab shell; its own shell also has a left area.
  optional: [ILabShell, ILayoutRestorer, ICommandPalette],
  activate: (
    app: JupyterFrontEnd,
    labShell: ILabShell | null,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null
  ): void => {
    const sidebar = new DistributedSidebar(distributedIcon);
    sidebar.title.label = labShell ? '' : 'Distributed';
    app.shell.add(sidebar, 'left', { rank: 700 });
    restorer?.add(sidebar, sidebar.id);

    app.commands.addCommand(CommandIDs.open, {
      label: 'Show the Distributed sidebar',
      caption:
        'Hardware, launch defaults and running launches of notebook_launcher',
      execute: () => {
        app.shell.activateById(sidebar.id);
      }
    });
    palette?.addItem({ command: CommandIDs.open, category: 'Distributed' });
  }
};

export default plugin;
