// The lineage as the panel and the status bar see it: read from {base}forkd/v1/tree, kept live by
// forkd's change events on jupyter_server's event bus, re-read whenever the bus comes back.

import { PageConfig } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';

import { hostLabel } from '../../forkd_magics/lineage.js';
import type { ILineageNode, LineageTree } from '../../forkd_magics/lineage.js';
import { ForkdAPI, ForkdError, IKernelHead, ITreeNode, ITreeRead } from './api';
import { EventSocket, SocketState } from './events';

export const CHANGE_SCHEMA = 'https://events.jupyter.org/forkd/change/v1';

/** A notebook path as JupyterLab names it: relative to the server's root (kernels may report it whole). */
export function relativePath(path: string): string {
  const root = (PageConfig.getOption('serverRoot') || '').replace(/\/+$/, '');
  return root && path.startsWith(root + '/') ? path.slice(root.length + 1) : path;
}
const REFRESH_DEBOUNCE = 250; // ms: a burst of events (60 children spawned) is one re-read
const MEMORY_EVERY = 15000; // ms: memory moves without events; re-read while the page is visible

export type ModelState = 'loading' | 'live' | 'reconnecting' | 'error';

export class LineageModel {
  constructor(settings: ServerConnection.ISettings) {
    this.api = new ForkdAPI(settings);
    this._socket = new EventSocket(
      settings,
      e => this.onEvent(e),
      s => this.onSocket(s)
    );
    this._memoryPoll = new Poll({
      factory: () => (this._state === 'live' ? this.refresh() : Promise.resolve()),
      frequency: { interval: MEMORY_EVERY, backoff: false },
      standby: 'when-hidden',
      name: 'forkd-lab:memory'
    });
  }

  readonly api: ForkdAPI;

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  get state(): ModelState {
    return this._state;
  }

  /** Why the state is what it is (empty when live). */
  get stateText(): string {
    return this._stateText;
  }

  get tree(): LineageTree {
    return this._tree;
  }

  /** The forkd kernels' HEADs (null: this server does not report them yet). */
  get kernels(): IKernelHead[] | null {
    return this._kernels;
  }

  /** Stop everything: the version check failed, or the server has no forkd. */
  fail(text: string): void {
    this._failed = true;
    this._socket.dispose();
    void this._memoryPoll.dispose();
    this.setState('error', text);
  }

  /** Reconnect now (button), else the socket retries on its own. */
  reconnect(): void {
    this._socket.retry();
  }

  dispose(): void {
    this._socket.dispose();
    this._memoryPoll.dispose();
    window.clearTimeout(this._timer);
  }

  /** Read the whole tree (with every sandbox's memory) and the kernels' HEADs. */
  async refresh(): Promise<void> {
    if (this._failed) {
      return;
    }
    if (this._inflight) {
      this._dirty = true;
      return this._inflight;
    }
    this._inflight = (async () => {
      try {
        // A reply that crossed an event may predate it (a node created meanwhile would vanish for
        // a moment, a status step back): read again, a few times at most; each event asks anyway.
        for (let tries = 0; ; tries++) {
          this._dirty = false;
          const seq = this._seq;
          // a server without forkd kernels answers 404 once; asked again when a kernel event comes
          const [read, kernels] = await Promise.all([
            this.api.tree(),
            this._kernelsRoute ? this.api.kernels() : Promise.resolve(this._kernels)
          ]);
          if ((this._seq !== seq || this._dirty) && tries < 4) {
            continue;
          }
          this._kernelsRoute = kernels !== null;
          this._kernels = kernels;
          this.setTree(read);
          break;
        }
        if (this._socket.state === 'open') {
          this.setState('live', this.silentText());
        }
      } catch (err) {
        if (err instanceof ForkdError && err.status === 404) {
          this.fail('this Jupyter server has no forkd routes: install forkd-jupyter in its environment and restart it');
        } else if (this._socket.state === 'open') {
          this.setState('error', `could not read the tree: ${(err as Error).message}`);
        }
      } finally {
        this._inflight = null;
      }
    })();
    return this._inflight;
  }

  private scheduleRefresh(): void {
    window.clearTimeout(this._timer);
    this._timer = window.setTimeout(() => void this.refresh(), REFRESH_DEBOUNCE);
  }

  private onSocket(state: SocketState): void {
    if (this._failed) {
      return;
    }
    if (state === 'open') {
      void this.refresh(); // catch up on whatever happened while the bus was down
    } else if (state === 'closed') {
      this.setState('reconnecting', 'the Jupyter server does not answer; retrying');
    }
  }

  private setState(state: ModelState, text: string): void {
    this._state = state;
    this._stateText = text;
    this._changed.emit();
  }

  // sandbox id -> the notebooks (and their kernels) whose HEAD it is
  private heads(): Record<string, { notebooks: string[]; kernels: string[] }> {
    const heads: Record<string, { notebooks: string[]; kernels: string[] }> = {};
    for (const k of this._kernels || []) {
      if (k.head) {
        const h = (heads[k.head] = heads[k.head] || { notebooks: [], kernels: [] });
        h.notebooks.push(k.notebook ? relativePath(k.notebook) : `kernel ${k.kernel_id.slice(0, 8)}`);
        h.kernels.push(k.kernel_id);
      }
    }
    return heads;
  }

  private node(n: ITreeNode, old?: ILineageNode): ILineageNode {
    const warnings = [...(n.warnings || [])];
    if (n.warning && !warnings.includes(n.warning)) {
      warnings.push(n.warning);
    }
    const history = this.history(n.id, n.status);
    return {
      kind: n.kind,
      parent: n.parent,
      lineage: n.lineage || null,
      status: history[history.length - 1],
      history,
      created: n.created_at,
      engine: n.engine,
      pause_ms: n.pause_ms,
      warnings,
      labels: n.labels || {},
      memory: n.memory === undefined ? old?.memory : n.memory,
      busy: n.kind === 'sandbox' && n.busy !== undefined ? n.busy || false : undefined,
      tier: n.kind === 'sandbox' ? n.tier || 'running' : undefined,
      stored: n.stored || null,
      host: n.host || null,
      hosts: n.hosts || null,
      info: { ...n }
    };
  }

  // The statuses a node went through. They only move forward (writing -> ready | failed, ready ->
  // failed), so one seen before is old news from a slower reply, not a step back.
  private history(id: string, status: string): string[] {
    const seen = (this._history[id] = this._history[id] || []);
    if (status === 'recovering') {
      // a restarted server has not settled it yet: shown while it lasts, never kept as a step
      return [...seen, status];
    }
    if (!seen.includes(status)) {
      seen.push(status);
    }
    return [...seen];
  }

  private setTree({ nodes, missing }: ITreeRead): void {
    const tree: LineageTree = {};
    const heads = this.heads();
    for (const n of nodes) {
      tree[n.id] = { ...this.node(n, this._tree[n.id]), heads: heads[n.id]?.notebooks || [], head_kernels: heads[n.id]?.kernels || [] };
    }
    // Behind a router, a host that did not answer in time is missing from the reply, not empty: what
    // it held stays drawn as last seen, marked, rather than vanish (and come back at the next read).
    for (const [id, old] of Object.entries(this._tree)) {
      const silent = (old.hosts || (old.host ? [old.host] : [])).find(h => h in missing);
      if (!tree[id] && silent) {
        tree[id] = { ...old, unanswered: `${hostLabel(silent)}: ${missing[silent]}` };
      }
    }
    this._missing = missing;
    for (const id of Object.keys(this._history)) {
      if (!tree[id]) {
        delete this._history[id];
      }
    }
    this._tree = tree;
    this._changed.emit();
  }

  /** What the state line says while hosts of a router are missing from the tree ('' when none). */
  private silentText(): string {
    const hosts = Object.keys(this._missing);
    if (!hosts.length) {
      return '';
    }
    const which = hosts.map(h => `${hostLabel(h)}: ${this._missing[h]}`).join(', ');
    return `${which}; what ${hosts.length > 1 ? 'these hosts hold is' : 'it holds is'} drawn as last seen`;
  }

  private withHeads(): void {
    const heads = this.heads();
    const tree: LineageTree = {};
    for (const [id, node] of Object.entries(this._tree)) {
      tree[id] = { ...node, heads: heads[id]?.notebooks || [], head_kernels: heads[id]?.kernels || [] };
    }
    this._tree = tree;
  }

  // One change from the bus, applied at once (so a new sandbox shows without waiting for a
  // read), then a debounced re-read brings the server's full view (lineage, engine, memory).
  private onEvent(event: Record<string, any>): void {
    if (event.schema_id !== CHANGE_SCHEMA || this._failed) {
      return;
    }
    this._seq++;
    const { kind, action } = event;
    if (kind === 'kernel') {
      this.onKernelEvent(event);
      return;
    }
    const id: string | undefined = kind === 'snapshot' ? event.tag : kind === 'sandbox' ? event.id : undefined;
    const tree = { ...this._tree };
    if (id && action === 'created' && !tree[id]) {
      const parent: string | null = kind === 'sandbox' ? event.snapshot_tag : event.branched_from || null;
      const up = parent ? tree[parent] : undefined;
      const head = this.heads()[id]; // a checkout's fresh child may be HEAD before its event arrives
      tree[id] = {
        kind,
        parent,
        lineage: up?.lineage ? [...up.lineage, id] : parent ? null : [id],
        status: event.status,
        history: this.history(id, event.status),
        created: event.time,
        engine: up?.engine,
        pause_ms: event.pause_ms ?? null,
        warnings: event.warnings || [],
        labels: event.labels || {},
        host: event.host || null, // a fleet's router names the host of what it passes on
        heads: head?.notebooks || [],
        head_kernels: head?.kernels || []
      };
    } else if (id && (action === 'killed' || action === 'deleted')) {
      delete tree[id]; // the drawing keeps it as a tombstone, marked killed / deleted (and nobody's HEAD)
    } else if (id && action === 'tier' && tree[id] && event.tier) {
      // frozen, stored, or woken to running: a sandbox not running runs nothing, a stored one holds no RAM
      const node = tree[id];
      tree[id] = {
        ...node,
        tier: event.tier,
        busy: event.tier === 'running' ? node.busy : undefined,
        memory: event.tier === 'stored' ? { rss_kib: 0, pss_kib: 0, uss_kib: 0 } : node.memory
      };
    } else if (id && action === 'stored' && tree[id] && event.digest) {
      tree[id] = { ...tree[id], stored: { digest: event.digest, remote: !!event.remote } };
    } else if (id && action === 'updated' && tree[id] && event.labels) {
      tree[id] = { ...tree[id], labels: event.labels }; // a checkout made it a notebook's
    } else if (id && action === 'status' && tree[id]) {
      const warnings = [...(event.warnings || tree[id].warnings || [])];
      if (event.warning && !warnings.includes(event.warning)) {
        warnings.push(event.warning);
      }
      const history = this.history(id, event.status);
      tree[id] = {
        ...tree[id],
        status: history[history.length - 1],
        history,
        pause_ms: event.pause_ms ?? tree[id].pause_ms,
        warnings
      };
    }
    this._tree = tree;
    this._changed.emit();
    this.scheduleRefresh();
  }

  private onKernelEvent(event: Record<string, any>): void {
    this._kernelsRoute = true;
    const kernels = (this._kernels || []).filter(k => k.kernel_id !== event.kernel_id);
    if (event.action === 'head') {
      kernels.push({ kernel_id: event.kernel_id, head: event.head, notebook: event.notebook });
    }
    this._kernels = kernels;
    this.withHeads();
    this._changed.emit();
  }

  private _changed = new Signal<this, void>(this);
  private _socket: EventSocket;
  private _memoryPoll: Poll;
  private _tree: LineageTree = {};
  private _history: Record<string, string[]> = {};
  private _missing: Record<string, string> = {};
  private _kernels: IKernelHead[] | null = null;
  private _kernelsRoute = true;
  private _state: ModelState = 'loading';
  private _stateText = 'reading the lineage…';
  private _inflight: Promise<void> | null = null;
  private _dirty = false;
  private _seq = 0;
  private _timer = 0;
  private _failed = false;
}
