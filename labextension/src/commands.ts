// Palette commands. Branch, fork and check out of the notebook itself go through its forkd kernel
// (`%forkd ...` lines run between cells, so the sandbox is idle); they are disabled, with the
// reason as caption, when the current notebook is not on that kernel. Progress as Kishu shows it:
// one notification, pending then success or error.

import { JupyterFrontEnd } from '@jupyterlab/application';
import { ICommandPalette, InputDialog, Notification } from '@jupyterlab/apputils';
import { age } from '../../forkd_magics/lineage.js';
import { LineageModel } from './model';
import { checkout, CurrentNotebook, NEEDS_FORKD_KERNEL, progress } from './notebook';
import { forkdIcon } from './panel';

export const CommandIDs = {
  open: 'forkd:open-lineage',
  branch: 'forkd:branch-notebook',
  fork: 'forkd:fork-notebook',
  checkout: 'forkd:checkout'
};

export function registerCommands(
  app: JupyterFrontEnd,
  model: LineageModel,
  notebook: CurrentNotebook,
  openPanel: () => void,
  palette: ICommandPalette | null
): void {
  const { commands } = app;
  const onForkd = () => !!notebook.forkdKernel;
  const caption = (what: string) => () => (onForkd() ? what : `${what}: ${NEEDS_FORKD_KERNEL}`);

  commands.addCommand(CommandIDs.open, {
    label: 'forkd: open lineage',
    caption: 'Show the forkd sidebar: snapshots, sandboxes and branches, live',
    icon: forkdIcon,
    execute: openPanel
  });

  commands.addCommand(CommandIDs.branch, {
    label: 'forkd: branch this notebook',
    caption: caption("Branch the notebook's sandbox (HEAD) into a new snapshot; it keeps running"),
    isEnabled: onForkd,
    execute: async () => {
      const name = notebook.name;
      await progress(
        notebook.runForkdLine('%forkd branch --live', false, { expressions: { tag: '_.tag', pause: '_.pause_ms' } }),
        `Branching ${name}…`,
        v => `Branched ${name} into snapshot ${v.tag}` + (/^[\d.]+$/.test(v.pause) ? ` (the notebook paused ${Number(v.pause).toFixed(1)} ms).` : '.'),
        `Could not branch ${name}`
      );
    }
  });

  commands.addCommand(CommandIDs.fork, {
    label: 'forkd: fork this notebook…',
    caption: caption("Start sandboxes from the notebook's state (HEAD stays where it is)"),
    isEnabled: onForkd,
    execute: async () => {
      const answer = await InputDialog.getNumber({
        title: `Fork ${notebook.name}`,
        label: 'How many sandboxes, each a copy of the notebook’s state?',
        value: 1
      });
      if (!answer.button.accept || answer.value === null) {
        return;
      }
      const n = Math.floor(answer.value);
      if (!(n >= 1 && n <= 100)) {
        Notification.warning('forkd: fork between 1 and 100 sandboxes', { autoClose: 4000 });
        return;
      }
      const name = notebook.name;
      await progress(
        notebook.runForkdLine(`%forkd fork -n ${n}`, false, { expressions: { ids: "', '.join(s.id for s in _)" } }),
        `Forking ${name} into ${n}…`,
        v => `Forked ${name} into ${n === 1 ? 'a sandbox' : `${n} sandboxes`} holding its state: ${v.ids}.`,
        `Could not fork ${name}`
      );
    }
  });

  commands.addCommand(CommandIDs.checkout, {
    label: args => (args.id ? `forkd: check out ${args.id}` : 'forkd: check out…'),
    caption: caption('Move the notebook to another sandbox: its next cell runs there'),
    isEnabled: onForkd,
    execute: async args => {
      let id = args.id as string | undefined;
      if (!id) {
        const now = Date.now() / 1000;
        const kernelId = notebook.kernel?.id;
        const head = (model.kernels || []).find(k => k.kernel_id === kernelId)?.head;
        const sandboxes = Object.entries(model.tree)
          .filter(([, n]) => n.kind === 'sandbox')
          .sort(([, a], [, b]) => (b.created ?? 0) - (a.created ?? 0));
        if (!sandboxes.length) {
          Notification.info('forkd: no running sandbox to check out', { autoClose: 4000 });
          return;
        }
        const items = sandboxes.map(([sid, n]) => `${sid} · from ${n.parent} · ${age(n.created, now)} old${sid === head ? ' · HEAD' : ''}`);
        const answer = await InputDialog.getItem({
          title: `Check out in ${notebook.name}`,
          label: 'The sandbox the next cell runs in:',
          items,
          current: Math.max(0, items.findIndex(i => i.startsWith(`${head} `)))
        });
        if (!answer.button.accept || !answer.value) {
          return;
        }
        id = answer.value.split(' ')[0];
      }
      await checkout(notebook, id);
    }
  });

  const changed = () => {
    for (const id of [CommandIDs.branch, CommandIDs.fork, CommandIDs.checkout]) {
      commands.notifyCommandChanged(id);
    }
  };
  notebook.tracker?.currentChanged.connect((_, panel) => {
    changed();
    panel?.sessionContext.kernelChanged.connect(changed);
  });

  if (palette) {
    for (const command of Object.values(CommandIDs)) {
      palette.addItem({ command, category: 'forkd' });
    }
  }
}
