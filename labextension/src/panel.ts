// The "forkd" sidebar: the shared lineage drawing (forkd_magics/lineage.js) over the live model,
// with REST actions, JupyterLab dialogs and notifications, and the current notebook's kernel.

import { Clipboard, Dialog, showDialog } from '@jupyterlab/apputils';
import { LabIcon } from '@jupyterlab/ui-components';
import { Widget } from '@lumino/widgets';

import { IAnswer, ILineageNode, IQuestion, LineageTree, LineageView } from '../../forkd_magics/lineage.js';
import { ForkdError } from './api';
import { LineageModel } from './model';
import { codeFor, CurrentNotebook, NEEDS_FORKD_KERNEL } from './notebook';

export const forkdIcon = new LabIcon({
  name: 'forkd-lab:lineage',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">' +
    '<g class="jp-icon3" fill="#616161"><circle cx="6" cy="4.5" r="2.5"/><circle cx="6" cy="19.5" r="2.5"/>' +
    '<circle cx="18" cy="12" r="2.5"/><path d="M5 6h2v11H5z"/>' +
    '<path d="M6 8.5c0 2.5 2 3.5 5 3.5h4.5v2H11C7 14 5 12 5 8.5z"/></g></svg>'
});

/** The Dialog body of a confirmation: the consequences, and an option box when there is one. */
class QuestionBody extends Widget implements Dialog.IBodyWidget<boolean> {
  constructor(question: IQuestion) {
    super();
    this.addClass('forkd-confirm-body');
    for (const line of question.body) {
      const p = document.createElement('p');
      p.textContent = line;
      this.node.appendChild(p);
    }
    if (question.option) {
      const label = document.createElement('label');
      this.box = document.createElement('input');
      this.box.type = 'checkbox';
      this.box.name = question.option.name;
      label.append(this.box, ` ${question.option.label}`);
      this.node.appendChild(label);
    }
  }

  getValue(): boolean {
    return !!this.box?.checked;
  }

  private box: HTMLInputElement | null = null;
}

export async function confirmDialog(question: IQuestion): Promise<IAnswer> {
  const result = await showDialog({
    title: question.title,
    body: new QuestionBody(question),
    buttons: [Dialog.cancelButton(), Dialog.warnButton({ label: question.ok })]
  });
  return { ok: result.button.accept, option: !!result.value };
}

export class LineagePanel extends Widget {
  constructor(
    readonly model: LineageModel,
    readonly notebook: CurrentNotebook,
    private checkout: (id: string) => Promise<void>
  ) {
    super();
    this.id = 'forkd-lineage';
    this.addClass('forkd-panel');
    this.title.icon = forkdIcon;
    this.title.caption = 'forkd: the lineage of snapshots and sandboxes';

    const tools = document.createElement('span');
    tools.className = 'forkd-panel-tools';
    this.filter = document.createElement('select');
    this.filter.className = 'forkd-filter';
    this.filter.setAttribute('aria-label', 'which snapshots and sandboxes');
    for (const [value, label] of [
      ['all', 'all'],
      ['notebook', 'this notebook']
    ]) {
      const o = document.createElement('option');
      o.value = value;
      o.textContent = label;
      this.filter.appendChild(o);
    }
    this.filter.title = 'this notebook: what its kernel made (labels jupyter.notebook / jupyter.kernel_id) and its HEAD';
    this.filter.addEventListener('change', () => this.update());
    const refresh = document.createElement('button');
    refresh.className = 'forkd-tool';
    refresh.type = 'button';
    refresh.textContent = '⟳';
    refresh.title = 'Read the tree again';
    refresh.setAttribute('aria-label', 'Read the tree again');
    refresh.addEventListener('click', () => void this.model.refresh());
    tools.append(this.filter, refresh);

    this.view = new LineageView(this.node, {
      fill: true,
      toolbar: tools,
      empty: 'No snapshots yet. Make one with %forkd snapshot, forkd snapshot, or POST /v1/snapshots.',
      act: (action, id, args) => this.act(action, id, args),
      confirm: confirmDialog,
      copy: async text => Clipboard.copyToSystem(text),
      extraActions: (id, node) => this.extraActions(id, node)
    });
    model.changed.connect(this.update, this);
    notebook.tracker?.currentChanged.connect(this.update, this);
    this.update();
  }

  readonly view: LineageView;

  dispose(): void {
    this.model.changed.disconnect(this.update, this);
    this.view.dispose();
    super.dispose();
  }

  update(): void {
    const m = this.model;
    this.view.update(this.filtered(m.tree));
    if (m.state === 'live') {
      this.view.setState('live', m.stateText); // e.g. a router's host that did not answer
    } else if (m.state === 'reconnecting') {
      this.view.setState('reconnecting', m.stateText, () => m.reconnect());
    } else if (m.state === 'loading') {
      this.view.setState('loading', m.stateText);
    } else {
      this.view.setState('error', m.stateText);
    }
  }

  // "this notebook": nodes its kernel made or whose HEAD it is, with their ancestors for context.
  // Nodes filtered out are handed to the drawing as well (never as "gone"): the drawing hides them.
  private filtered(tree: LineageTree): LineageTree {
    if (this.filter.value !== 'notebook') {
      this.view.setOnly(null);
      return tree;
    }
    const path = this.notebook.path;
    const kernelId = this.notebook.kernel?.id;
    this.view.setOnly((id: string, node: ILineageNode) => {
      const labels = node.labels || {};
      return (
        (!!path && labels['jupyter.notebook'] === path) ||
        (!!kernelId && (labels['jupyter.kernel_id'] === kernelId || (node.head_kernels || []).includes(kernelId)))
      );
    }, path ? `Nothing here is labelled with ${path} (jupyter.notebook) or its kernel, nor is its HEAD.` : 'No notebook is open.');
    return tree;
  }

  private async act(action: string, id: string, args: Record<string, any>): Promise<string | null> {
    const api = this.model.api;
    switch (action) {
      case 'fork': {
        const kids = await api.spawn(id, args.n);
        return `forked ${kids.length} sandbox${kids.length === 1 ? '' : 'es'} from ${id}`;
      }
      case 'branch':
        return this.branch(id, args.mode);
      case 'kill':
        await api.kill(id);
        return `killed ${id}`;
      case 'delete':
        await api.deleteSnapshot(id, !!args.cascade);
        return `deleted ${id}${args.cascade ? ' and the snapshots branched from it' : ''}`;
    }
    throw new Error(`unknown action ${action}`);
  }

  // A branch that would lose running work is refused (409) and says what; the user may then branch
  // anyway with "lossy", and the new snapshot carries the warnings.
  private async branch(id: string, mode: string): Promise<string> {
    try {
      const info = await this.model.api.branch(id, mode);
      return `branched ${id} into ${info.tag}`;
    } catch (err) {
      if (!(err instanceof ForkdError && err.status === 409 && err.message.includes('lossy'))) {
        throw err;
      }
      const answer = await confirmDialog({
        title: `Branch ${id} anyway?`,
        body: [err.message, 'Branching anyway makes the snapshot without them; it carries the warnings.'],
        ok: 'Branch anyway (lossy)'
      });
      if (!answer.ok) {
        return `did not branch ${id}`;
      }
      const info = await this.model.api.branch(id, mode, true);
      return `branched ${id} into ${info.tag} with ${info.warnings?.length ?? 0} warning(s)`;
    }
  }

  // "Keep this one" on a child of a fork tree: asks first (its siblings are killed), then promotes.
  private async keep(id: string, treeId: string): Promise<string | null> {
    const siblings = Object.entries(this.model.tree)
      .filter(([other, n]) => other !== id && n.kind === 'sandbox' && n.labels?.['fork_tree_id'] === treeId)
      .map(([other]) => other);
    const answer = await confirmDialog({
      title: `Keep ${id}?`,
      body: [
        `It wins fork tree ${treeId}: ${siblings.length} sibling${siblings.length === 1 ? '' : 's'} ` +
          `${siblings.length === 1 ? 'is' : 'are'} killed${siblings.length ? ` (${siblings.join(', ')})` : ''}, ` +
          "and the tree's snapshot is released if nothing needs it.",
        'A sibling another notebook runs in or has checked out stays, and so does a snapshot with your tag.'
      ],
      ok: 'Keep this one'
    });
    if (!answer.ok) {
      return null;
    }
    const done = await this.model.api.promote(id, treeId);
    const parts = [`kept ${id}: killed ${done.killed.length} sibling${done.killed.length === 1 ? '' : 's'}`];
    if (done.released.length) {
      parts.push(`released ${done.released.join(', ')}`);
    }
    for (const k of done.kept) {
      parts.push(`kept ${k.id} (${k.reason})`);
    }
    for (const f of done.failed) {
      parts.push(`could not kill ${f.id}: ${f.error}`);
    }
    return parts.join('; ');
  }

  private extraActions(id: string, node: ILineageNode) {
    const gone = node.ghost || node.status === 'killed' || node.status === 'deleted';
    const out = [];
    const hasNotebook = !!this.notebook.panel;
    if (node.kind === 'sandbox' && !gone) {
      const forkd = !!this.notebook.forkdKernel;
      out.push({
        action: 'checkout',
        label: 'Check out',
        title: forkd
          ? `Make ${id} the HEAD of ${this.notebook.name}: its next cell runs there`
          : `Check out into the current notebook: ${NEEDS_FORKD_KERNEL}`,
        disabled: !forkd,
        needsLive: true,
        run: async () => {
          await this.checkout(id);
          return null;
        }
      });
    }
    const treeId = node.labels?.['fork_tree_id'];
    if (node.kind === 'sandbox' && !gone && treeId) {
      out.push({
        action: 'keep',
        label: 'Keep this one',
        title: `Keep ${id}, the winner of fork tree ${treeId}: its siblings are killed`,
        needsLive: true,
        run: () => this.keep(id, treeId)
      });
    }
    if (!gone) {
      out.push({
        action: 'insert',
        label: 'Insert code',
        title: hasNotebook ? `Insert a cell that reaches ${id} into ${this.notebook.name}` : 'Open a notebook first',
        disabled: !hasNotebook,
        run: async () => {
          const kind = node.kind;
          return this.notebook.insertCode(codeFor(id, kind, this.notebook.kernelName))
            ? `inserted a cell for ${id} into ${this.notebook.name}`
            : 'no notebook to insert into';
        }
      });
    }
    return out;
  }

  private filter: HTMLSelectElement;
}
