// Types of lineage.js (the drawing, with lineage_tree.js re-exported), shared by the widget and the
// JupyterLab extension: forkd-lab imports the .js file; TypeScript reads this declaration next to it.

export interface ILineageNode {
  kind: 'snapshot' | 'sandbox';
  parent: string | null;
  lineage?: string[] | null;
  status: string;
  history?: string[];
  created?: number | null;
  engine?: string;
  pause_ms?: number | null;
  warnings?: string[];
  warning?: string;
  memory?: { uss_kib?: number; pss_kib?: number; rss_kib?: number } | null;
  labels?: Record<string, string>;
  heads?: string[]; // notebooks whose HEAD it is
  head_kernels?: string[]; // and their kernels' ids
  busy?: string | boolean; // what it runs (a string), false when idle
  tier?: 'running' | 'frozen' | 'stored'; // a sandbox's: frozen (paused, no CPU), stored (in the store, no RAM)
  stored?: { digest: string; remote: boolean } | null; // a snapshot kept in the store (remote: pushed)
  host?: string | null; // behind a fleet's router: the host that holds it (a snapshot: the first of hosts)
  hosts?: string[] | null; // a snapshot's: every host that holds it
  ghost?: boolean;
  unanswered?: string; // behind a router: its host did not answer the last read (why); drawn as last seen
  tomb?: boolean; // gone from the server, kept in the drawing until "clear gone"
  info?: Record<string, unknown>;
}

export type LineageTree = Record<string, ILineageNode>;

export interface IQuestion {
  title: string;
  body: string[];
  ok: string;
  option?: { name: string; label: string } | null;
}

export interface IAnswer {
  ok: boolean;
  option: boolean;
}

export interface IExtraAction {
  action: string;
  label: string;
  title?: string;
  disabled?: boolean;
  needsLive?: boolean;
  run: () => Promise<string | null>;
}

export interface ILineageViewOptions {
  act: (action: string, id: string, args: Record<string, unknown>) => Promise<string | null>;
  confirm?: (question: IQuestion) => Promise<IAnswer>;
  extraActions?: (id: string, node: ILineageNode) => IExtraAction[];
  copy?: (text: string) => Promise<void>;
  clearGone?: () => void; // the host keeps gone nodes in its tree (marked tomb) and forgets them here
  toolbar?: HTMLElement;
  fill?: boolean;
  empty?: string;
}

export declare const GROUP_MIN: number;
export declare const ROW: number;
export declare const INDENT: number;
export declare const DEEP: number;
export declare const INDENT_DEEP: number;
export declare const ROW_MIN: number;
export declare function indentOf(depth: number): number;
export declare function age(created: number | null | undefined, now: number): string;
export declare function fmtMs(ms: number | null | undefined): string;
export declare function fmtKib(kib: number | null | undefined): string;
export declare function warningsOf(node: ILineageNode): string[];
export declare function withGhosts(tree: LineageTree): LineageTree;
export declare function hostsOf(tree: LineageTree): string[];
export declare function hostLabel(url: string): string;
export declare function summary(tree: LineageTree): { snapshots: number; sandboxes: number; memory_kib: number | null };
export declare function describeKill(tree: LineageTree, id: string): IQuestion;
export declare function describeDelete(tree: LineageTree, tag: string): IQuestion;

export declare class LineageView {
  constructor(host: HTMLElement, opts: ILineageViewOptions);
  readonly root: HTMLElement;
  selected: string | null;
  update(tree: LineageTree): void;
  setState(state: 'live' | 'loading' | 'reconnecting' | 'disconnected' | 'error', text?: string, reconnect?: (() => void) | null): void;
  setMessage(text: string, error?: boolean): void;
  select(id: string | null): void;
  setOnly(only: ((id: string, node: ILineageNode) => boolean) | null, empty?: string): void;
  fit(): void;
  render(): void;
  dispose(): void;
}
