// "forkd: 3 snapshots · 12 sandboxes · 1.2 GiB" in the status bar (private memory of the sandboxes
// in all); a click opens the panel.

import { Widget } from '@lumino/widgets';
import { fmtKib, summary } from '../../forkd_magics/lineage.js';
import { LineageModel } from './model';

export class ForkdStatus extends Widget {
  constructor(
    private model: LineageModel,
    open: () => void
  ) {
    super({ node: document.createElement('button') });
    this.addClass('jp-StatusBar-TextItem');
    this.addClass('forkd-status');
    this.node.setAttribute('type', 'button');
    this.node.addEventListener('click', open);
    model.changed.connect(this.refresh, this);
    this.refresh();
  }

  refresh(): void {
    const m = this.model;
    let text: string;
    if (m.state === 'error') {
      text = 'forkd: unavailable';
    } else if (m.state === 'reconnecting' || m.state === 'loading') {
      text = 'forkd: reconnecting…';
    } else {
      const s = summary(m.tree);
      const plural = (n: number, one: string, many: string) => `${n} ${n === 1 ? one : many}`;
      text = `forkd: ${plural(s.snapshots, 'snapshot', 'snapshots')} · ${plural(s.sandboxes, 'sandbox', 'sandboxes')}`;
      if (s.memory_kib !== null) {
        text += ` · ${fmtKib(s.memory_kib)}`;
      }
    }
    this.node.textContent = text;
    this.node.title =
      m.state === 'live' && !m.stateText ? 'Open the forkd lineage (private memory of the sandboxes in all)' : `forkd: ${m.stateText}`;
  }

  dispose(): void {
    this.model.changed.disconnect(this.refresh, this);
    super.dispose();
  }
}
