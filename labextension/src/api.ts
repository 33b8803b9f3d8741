// The forkd REST routes as the server extension serves them inside Jupyter: {base}forkd/...
// (the same routes `forkd serve` has at its root). Requests carry Jupyter's own auth (token, XSRF)
// through ServerConnection; errors keep forkd's {"error": "..."} message.

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export interface ITreeNode {
  id: string;
  kind: 'snapshot' | 'sandbox';
  parent: string | null;
  lineage?: string[];
  status: string;
  pause_ms: number | null;
  created_at: number;
  engine: string;
  memory?: { rss_kib: number; pss_kib: number; uss_kib: number } | null;
  busy?: string | null;
  warnings?: string[];
  warning?: string;
  labels?: Record<string, string>;
  tier?: 'running' | 'frozen' | 'stored';
  stored?: { digest: string; remote: boolean };
  host?: string; // behind a fleet's router: the host that holds it
  hosts?: string[]; // a snapshot several hosts hold: each of them
}

/** A tree as read: its nodes, and behind a router the hosts whose part is missing (url -> why). */
export interface ITreeRead {
  nodes: ITreeNode[];
  missing: Record<string, string>;
}

const MISSING_HEADER = 'X-Forkd-Hosts-Missing'; // a router's: "url: why; url: why" of hosts that did not answer

/** The hosts a router's merged answer lacks, by url, from its header (each "url: why", "; " between). */
export function missingHosts(header: string | null): Record<string, string> {
  const out: Record<string, string> = {};
  let last = '';
  for (const part of (header || '').split('; ')) {
    const m = /^(https?:\/\/\S+?): (.*)$/.exec(part.trim());
    if (m) {
      out[(last = m[1])] = m[2];
    } else if (last) {
      out[last] += '; ' + part; // a reason of its own with "; " in it
    }
  }
  return out;
}

export interface IKernelHead {
  kernel_id: string;
  head: string | null;
  notebook?: string | null;
  base_snapshot?: string | null;
  engine?: string;
  updated_at?: number;
}

/** What a promote did: the siblings killed, the snapshots released, and what stayed and why. */
export interface IPromoted {
  fork_tree_id: string;
  killed: string[];
  released: string[];
  kept: { id: string; kind: string; reason: string }[];
  failed: { id: string; error: string }[];
}

/** A reply with an error status: `message` is the server's `error`. */
export class ForkdError extends Error {
  constructor(
    readonly status: number,
    message: string
  ) {
    super(message);
  }
}

/** The server did not answer at all (restarting, gone, network). */
export class ForkdUnreachable extends Error {}

const RECOVERING_POLL_MS = 250; // between asks while a restarted server settles what it recorded
const RECOVERING_WAIT_MS = 60000; // then its 503 is shown as any error is

export class ForkdAPI {
  constructor(readonly settings: ServerConnection.ISettings) {}

  url(...parts: string[]): string {
    return URLExt.join(this.settings.baseUrl, 'forkd', ...parts);
  }

  async request<T>(path: string, init: RequestInit = {}): Promise<T> {
    return (await this.read<T>(path, init)).body;
  }

  /** A request's parsed answer and the response it came in (its headers). */
  private async read<T>(path: string, init: RequestInit = {}): Promise<{ body: T; response: Response }> {
    const started = Date.now();
    for (;;) {
      let response: Response;
      try {
        response = await ServerConnection.makeRequest(this.url(path), init, this.settings);
      } catch (err) {
        throw new ForkdUnreachable(`the Jupyter server does not answer: ${(err as Error).message}`);
      }
      const text = await response.text();
      let body: any = null;
      try {
        body = text ? JSON.parse(text) : null;
      } catch {
        body = null;
      }
      // A restarted server answers 503 `recovering` (having done nothing) about what it has not
      // settled yet: ask again shortly, as the SDK does, rather than show the user a refusal.
      if (response.status === 503 && body?.recovering === true && Date.now() - started < RECOVERING_WAIT_MS) {
        await new Promise(resolve => window.setTimeout(resolve, RECOVERING_POLL_MS));
        continue;
      }
      return { body: this.answer<T>(response, body), response };
    }
  }

  private answer<T>(response: Response, body: any): T {
    if (!response.ok) {
      const message = body && typeof body.error === 'string' ? body.error : `${response.status} ${response.statusText}`;
      throw new ForkdError(response.status, message);
    }
    return body as T;
  }

  private send<T>(method: string, path: string, body?: unknown): Promise<T> {
    return this.request<T>(path, {
      method,
      body: body === undefined ? undefined : JSON.stringify(body),
      headers: body === undefined ? undefined : { 'Content-Type': 'application/json' }
    });
  }

  version(): Promise<{ version: string; api: string }> {
    return this.request('version');
  }

  /** The whole tree, with each sandbox's memory and what it runs (one request for all of them). */
  async tree(): Promise<ITreeRead> {
    const { body, response } = await this.read<ITreeNode[]>('v1/tree?memory=true&busy=true');
    return { nodes: body, missing: missingHosts(response.headers.get(MISSING_HEADER)) };
  }

  /** The forkd kernels' HEADs; null when this server has no such route yet (404). */
  async kernels(): Promise<IKernelHead[] | null> {
    try {
      return await this.request<IKernelHead[]>('v1/kernels');
    } catch (err) {
      if (err instanceof ForkdError && err.status === 404) {
        return null;
      }
      throw err;
    }
  }

  spawn(tag: string, n: number): Promise<{ id: string }[]> {
    return this.send('POST', 'v1/sandboxes', { snapshot_tag: tag, n });
  }

  kill(id: string): Promise<void> {
    return this.send('DELETE', `v1/sandboxes/${encodeURIComponent(id)}`);
  }

  branch(id: string, mode: string, lossy = false): Promise<{ tag: string; pause_ms?: number; warnings?: string[] }> {
    // live answers at once (the snapshot is `writing` until the events say `ready`); diff and full
    // copy memory in the pause, so the server answers when the snapshot is ready
    const body: Record<string, unknown> = mode === 'live' ? { mode, wait: false } : { mode };
    if (lossy) {
      body.lossy = true;
    }
    return this.send('POST', `v1/sandboxes/${encodeURIComponent(id)}/branch`, body);
  }

  /** Keep ``id``, the winner of its fork tree: its siblings are killed (what another notebook holds stays). */
  promote(id: string, treeId: string): Promise<IPromoted> {
    return this.send('POST', `v1/sandboxes/${encodeURIComponent(id)}/promote`, {
      tree_id: treeId,
      cleanup_siblings: true
    });
  }

  deleteSnapshot(tag: string, cascade: boolean): Promise<void> {
    return this.send('DELETE', `v1/snapshots/${encodeURIComponent(tag)}${cascade ? '?cascade=true' : ''}`);
  }
}
