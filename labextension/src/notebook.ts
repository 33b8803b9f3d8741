// The current notebook, as the panel and the commands act on it: its forkd kernel (HEAD, checkout,
// branch and fork of the notebook itself go through the kernel, between cells, as ipyparallel's
// panel acts on the current kernel) and inserting a cell.

import { NotebookActions, INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { Dialog, Notification, showDialog } from '@jupyterlab/apputils';
import { Kernel, KernelMessage } from '@jupyterlab/services';
import { ReadonlyJSONValue } from '@lumino/coreutils';

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

  /** The current notebook's kernel name (the one it is starting with, while it starts), else null. */
  get kernelName(): string | null {
    return this.kernel?.name ?? this.panel?.sessionContext.kernelPreference.name ?? null;
  }

  /**
   * Run one `%forkd` line in the forkd kernel (queued behind running cells, so the sandbox is idle
   * when it runs). `expressions` are evaluated after it, where it ran (the protocol's
   * user_expressions; `_` is the line's result): their values come back as text, strings unquoted.
   * What it wrote to stderr (the kernel's `forkd: ...` notes) goes to `warn` once it succeeded.
   * Throws the kernel's error, as a sentence.
   */
  async runForkdLine(
    code: string,
    silent: boolean,
    { expressions = {}, warn }: { expressions?: Record<string, string>; warn?: (text: string) => void } = {}
  ): Promise<Record<string, string>> {
    const kernel = this.forkdKernel;
    if (!kernel) {
      throw new Error(NEEDS_FORKD_KERNEL);
    }
    const future = kernel.requestExecute({
      code,
      silent,
      store_history: false,
      allow_stdin: false,
      stop_on_error: false,
      user_expressions: expressions
    });
    let warnings = '';
    let error = '';
    future.onIOPub = (msg: KernelMessage.IIOPubMessage) => {
      if (KernelMessage.isStreamMsg(msg) && msg.content.name === 'stderr') {
        warnings += msg.content.text;
      } else if (KernelMessage.isErrorMsg(msg)) {
        error = errorText(msg.content.ename, msg.content.evalue);
      }
    };
    const reply = await future.done;
    if (reply.content.status !== 'ok') {
      const c = reply.content as KernelMessage.IReplyErrorContent;
      throw new Error(error || errorText(c.ename, c.evalue));
    }
    if (warn && warnings.trim()) {
      warn(warnings.trim());
    }
    const values: Record<string, string> = {};
    const found = (reply.content as KernelMessage.IExecuteReply).user_expressions ?? {};
    for (const [name, value] of Object.entries(found) as [string, any][]) {
      const text = value?.status === 'ok' ? String(value.data?.['text/plain'] ?? '') : '';
      values[name] = /^'[^'\\]*'$/.test(text) ? text.slice(1, -1) : text;
    }
    return values;
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

const SAFE_ID = /^[A-Za-z0-9][A-Za-z0-9._-]*$/; // what goes into a %forkd line as it is

/**
 * A cell that reaches a snapshot or sandbox from the notebook's kernel. On the forkd kernel, %forkd
 * lines: its cells run in a sandbox, which cannot reach the server, while %forkd lines run in the
 * kernel, which found the Jupyter server it was started by. On any other Python kernel, the client
 * SDK, which finds that same server (its runtime file, the kernel's parent) by itself.
 */
export function codeFor(id: string, kind: 'snapshot' | 'sandbox', kernelName: string | null): string {
  if (kernelName === FORKD_KERNEL) {
    const arg = SAFE_ID.test(id) ? id : JSON.stringify(id);
    return kind === 'snapshot'
      ? `# sandboxes forked from ${id}; %%forkd run kids runs a cell in them\nkids = %forkd fork -t ${arg} -n 1`
      : `%%forkd run ${arg}\n1 + 1`;
  }
  const q = JSON.stringify(id);
  return kind === 'snapshot'
    ? `from forkd_server.client import Snapshot\n\nsnap = Snapshot(${q})\nkids = snap.fork(1)  # sandboxes forked from ${id}\nkids`
    : `from forkd_server.client import Sandbox\n\nsb = Sandbox.connect(${q})\nsb.run_code("1 + 1").text`;
}

/** A kernel's error as a sentence: a UsageError's message is one already ("forkd fork: ..."). */
function errorText(ename: string, evalue: string): string {
  return ename === 'UsageError' || !ename ? evalue : `${ename}: ${evalue}`;
}

const QUIET_MS = 400; // work done this soon needs no spinner: its result alone is shown
const SHOWN_WITHIN_MS = 2000; // a toast not drawn by then is not drawn (do-not-disturb, the list open)

/**
 * Kishu's way: one notification, pending then success or error; null when it failed. Not
 * ``Notification.promise``: JupyterLab's toasts drop an update that arrives before the pending
 * toast is first drawn (react-toastify draws on a later task), which left a spinner forever after
 * a branch of a few milliseconds. So quick work shows only its result, and slow work's result
 * waits until its pending toast is on the page.
 */
export async function progress<T extends ReadonlyJSONValue>(
  work: Promise<T>,
  pending: string,
  ok: (value: T) => string,
  failed: string
): Promise<T | null> {
  const outcome = work.then(
    value => ({ value, message: ok(value), type: 'success' as const, autoClose: 3000 }),
    (err: any) => ({ value: null, message: `${failed}: ${err?.message ?? err}`, type: 'error' as const, autoClose: 6000 })
  );
  const quick = await Promise.race([outcome, delay(QUIET_MS).then(() => null)]);
  if (quick) {
    Notification.emit(quick.message, quick.type, { autoClose: quick.autoClose });
    return quick.value;
  }
  const id = Notification.emit(pending, 'in-progress', { autoClose: false });
  const done = await outcome;
  void drawn(id).then(() => Notification.update({ id, message: done.message, type: done.type, autoClose: done.autoClose }));
  return done.value;
}

function delay(ms: number): Promise<void> {
  return new Promise(resolve => setTimeout(resolve, ms));
}

/** The notification's toast is on the page (react-toastify gives it the notification's id). */
async function drawn(id: string): Promise<void> {
  const until = Date.now() + SHOWN_WITHIN_MS;
  while (!document.getElementById(id) && Date.now() < until) {
    await delay(50);
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
    notebook.runForkdLine(`%forkd checkout ${id}`, true, { warn: warnUser }),
    `Checking out ${id} in ${name}…`,
    () => `Checked out ${id}: the next cell of ${name} runs there.`,
    `Could not check out ${id}`
  );
  return done !== null;
}
