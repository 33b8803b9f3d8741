// The current notebook, as the panel and the commands act on it: its forkd kernel (HEAD, checkout,
// branch and fork of the notebook itself go through the kernel, between cells, as ipyparallel's
// panel acts on the current kernel) and inserting a cell.

import { NotebookActions, INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Dialog, Notification, showDialog } from '@jupyterlab/apputils';
import { Kernel, KernelMessage } from '@jupyterlab/services';

export const FORKD_KERNEL = 'forkd-python';
export const NEEDS_FORKD_KERNEL =
  'needs the current notebook on the forkd kernel (forkd-python): Kernel › Change Kernel…';

export class CurrentNotebook {
  constructor(readonly tracker: INotebookTracker | null) {}

  get panel(): NotebookPanel | null {
    return this.tracker?.currentWidget ?? null;
  }

  get path(): string | null {
    return this.panel?.context.path ?? null;
  }

  get kernel(): Kernel.IKernelConnection | null {
    return this.panel?.sessionContext.session?.kernel ?? null;
  }

  /** The current notebook's kernel when it is a forkd kernel, else null. */
  get forkdKernel(): Kernel.IKernelConnection | null {
    const kernel = this.kernel;
    return kernel && kernel.name === FORKD_KERNEL ? kernel : null;
  }

  /** The notebook's name for messages. */
  get name(): string {
    return this.path ?? 'the notebook';
  }

  /**
   * Run one `%forkd` line in the forkd kernel (queued behind running cells, so the sandbox is idle
   * when it runs). Returns what the line printed or returned as text; throws the kernel's error.
   * What it wrote to stderr (the kernel's `forkd: ...` notes) goes to `warn` once it succeeded.
   */
  async runForkdLine(code: string, silent: boolean, warn?: (text: string) => void): Promise<string> {
    const kernel = this.forkdKernel;
    if (!kernel) {
      throw new Error(NEEDS_FORKD_KERNEL);
    }
    const future = kernel.requestExecute({ code, silent, store_history: false, allow_stdin: false, stop_on_error: false });
    let text = '';
    let warnings = '';
    let error = '';
    future.onIOPub = (msg: KernelMessage.IIOPubMessage) => {
      if (KernelMessage.isExecuteResultMsg(msg)) {
        text += String((msg.content.data as Record<string, unknown>)['text/plain'] ?? '');
      } else if (KernelMessage.isStreamMsg(msg) && msg.content.name === 'stderr' && warn) {
        warnings += msg.content.text;
      } else if (KernelMessage.isStreamMsg(msg)) {
        text += msg.content.text;
      } else if (KernelMessage.isErrorMsg(msg)) {
        error = `${msg.content.ename}: ${msg.content.evalue}`;
      }
    };
    const reply = await future.done;
    if (reply.content.status !== 'ok') {
      const c = reply.content as KernelMessage.IReplyErrorContent;
      throw new Error(error || `${c.ename}: ${c.evalue}`);
    }
    if (warn && warnings.trim()) {
      warn(warnings.trim());
    }
    return text.trim();
  }

  /** Insert a code cell below the active cell of the current notebook. */
  insertCode(source: string): boolean {
    const panel = this.panel;
    if (!panel) {
      return false;
    }
    const notebook = panel.content;
    NotebookActions.insertBelow(notebook);
    const cell = notebook.activeCell;
    if (!cell) {
      return false;
    }
    cell.model.sharedModel.setSource(source);
    return true;
  }
}

/** Code that reaches a snapshot or sandbox from any Python kernel, through the client SDK. */
export function codeFor(id: string, kind: 'snapshot' | 'sandbox'): string {
  const q = JSON.stringify(id);
  return kind === 'snapshot'
    ? `from forkd_server.client import Snapshot\n\nsnap = Snapshot(${q})\nkids = snap.fork(1)  # sandboxes forked from ${id}\nkids`
    : `from forkd_server.client import Sandbox\n\nsb = Sandbox.connect(${q})\nsb.run_code("1 + 1").text`;
}

const SAFE_ID = /^[A-Za-z0-9][A-Za-z0-9._-]*$/; // what goes into a %forkd line

/** Kishu's way: one notification, pending then success or error; null when it failed. */
export async function progress(work: Promise<string>, pending: string, ok: (value: string) => string, failed: string): Promise<string | null> {
  Notification.promise(work, {
    pending: { message: pending, options: { autoClose: false } },
    success: { message: (value: unknown) => ok(String(value ?? '')), options: { autoClose: 3000 } },
    error: { message: (err: any) => `${failed}: ${err?.message ?? err}`, options: { autoClose: 6000 } }
  });
  try {
    return await work;
  } catch {
    return null; // the notification said why
  }
}

/**
 * A note of the kernel's the user must see (a checkout raised a sandbox's memory limit, or could
 * not): a warning that stays until dismissed, the whole text a click away (toasts cut at 140).
 */
export function warnUser(text: string): void {
  Notification.warning(text, {
    autoClose: false,
    actions: [
      {
        label: 'Details',
        caption: 'Show the whole message',
        callback: () => void showDialog({ title: 'forkd', body: text, buttons: [Dialog.okButton()] })
      }
    ]
  });
}

/** Check out a sandbox in the current forkd notebook: `%forkd checkout <id>`, silently. */
export async function checkout(notebook: CurrentNotebook, id: string): Promise<boolean> {
  if (!SAFE_ID.test(id)) {
    Notification.error(`forkd: ${JSON.stringify(id)} is not a sandbox id`, { autoClose: 5000 });
    return false;
  }
  const name = notebook.name;
  const done = await progress(
    notebook.runForkdLine(`%forkd checkout ${id}`, true, warnUser),
    `Checking out ${id} in ${name}…`,
    () => `Checked out ${id}: the next cell of ${name} runs there.`,
    `Could not check out ${id}`
  );
  return done !== null;
}
