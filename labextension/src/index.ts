// forkd-lab: the forkd extension for JupyterLab.

import { JupyterFrontEnd, JupyterFrontEndPlugin } from '@jupyterlab/application';
import { showErrorMessage } from '@jupyterlab/apputils';

import { ForkdAPI, ForkdError } from './api';

/** This extension's version; the forkd server extension must report the same (like jupyterlab-git). */
export const VERSION: string = require('../package.json').version;

// Refuse to drive a server whose forkd differs from the one this extension was built with.
async function checkVersion(api: ForkdAPI): Promise<boolean> {
  let server: { version: string; api: string };
  try {
    server = await api.version();
  } catch (err) {
    if (err instanceof ForkdError && err.status === 404) {
      console.warn('forkd-lab: this Jupyter server has no forkd routes (install forkd-jupyter and restart it)');
    }
    return false;
  }
  if (server.version !== VERSION || server.api !== 'v1') {
    const text =
      `forkd-lab ${VERSION} needs the forkd server extension ${VERSION} (API v1); this server runs ` +
      `${server.version} (API ${server.api}). Install matching versions (pip install forkd-jupyter==${VERSION} ` +
      `forkd_lab==${VERSION}) and restart JupyterLab.`;
    void showErrorMessage('forkd: the extension and the server differ', text);
    return false;
  }
  return true;
}

const plugin: JupyterFrontEndPlugin<void> = {
  id: 'forkd-lab:plugin',
  description: 'forkd for JupyterLab.',
  autoStart: true,
  activate: (app: JupyterFrontEnd) => {
    void checkVersion(new ForkdAPI(app.serviceManager.serverSettings));
  }
};

export default plugin;
