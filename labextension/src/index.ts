// forkd-lab: the forkd sidebar (left, below git), palette commands and a status-bar item.

import { ILayoutRestorer, JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { ICommandPalette, showErrorMessage } from '@jupyterlab/apputils';
import { INotebookTracker } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';

import { ForkdError } from './api';
import { CommandIDs, registerCommands } from './commands';
import { LineageModel } from './model';
import { checkout, CurrentNotebook } from './notebook';
import { LineagePanel } from './panel';
import { ForkdStatus } from './statusbar';

/** This extension's version; the forkd server extension must report the same (like jupyterlab-git). */
export const VERSION: string = require('../package.json').version;

// Refuse to drive a server whose forkd differs from the one this panel was built with: the panel
// says why and does nothing, and a dialog tells the user once.
async function checkVersion(model: LineageModel): Promise<void> {
  let server: { version: string; api: string };
  try {
    server = await model.api.version();
  } catch (err) {
    if (err instanceof ForkdError && err.status === 404) {
      model.fail('this Jupyter server has no forkd routes: install forkd-jupyter in its environment and restart it');
    }
    return; // unreachable: the event socket shows "reconnecting" and retries
  }
  if (server.version !== VERSION || server.api !== 'v1') {
    const text =
      `forkd-lab ${VERSION} needs the forkd server extension ${VERSION} (API v1); this server runs ` +
      `${server.version} (API ${server.api}). Install matching versions (pip install forkd-jupyter==${VERSION} ` +
      `forkd_lab==${VERSION}) and restart JupyterLab.`;
    model.fail(text);
    void showErrorMessage('forkd: the panel and the server differ', text);
  }
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'forkd-lab:plugin',
  description: 'The forkd sidebar: the lineage of snapshots and sandboxes, live, with its actions.',
  autoStart: true,
  optional: [ILayoutRestorer, ICommandPalette, IStatusBar, INotebookTracker],
  activate: (
    app: JupyterFrontEnd,
    restorer: ILayoutRestorer | null,
    palette: ICommandPalette | null,
    statusBar: IStatusBar | null,
    tracker: INotebookTracker | null
  ) => {
    const model = new LineageModel(app.serviceManager.serverSettings);
    const notebook = new CurrentNotebook(tracker);
    const panel = new LineagePanel(model, notebook, async id => {
      await checkout(notebook, id);
    });
    const open = () => app.shell.activateById(panel.id);
    app.shell.add(panel, 'left', { rank: 400 });
    restorer?.add(panel, 'forkd-lineage');
    registerCommands(app, model, notebook, open, palette);
    statusBar?.registerStatusItem('forkd-lab:status', {
      item: new ForkdStatus(model, () => void app.commands.execute(CommandIDs.open)),
      align: 'left',
      rank: 5
    });
    void checkVersion(model);
  }
};

export default plugin;
