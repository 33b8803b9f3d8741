// jupyter_server's event bus (api/events/subscribe), on a socket of the panel's own.
//
// JupyterLab's shared EventManager (app.serviceManager.events) reconnects through a Poll whose
// back-off grows by up to 3x per failed try, to 30 s, and never resets while connected; it also
// says nothing about its socket. The panel must show "reconnecting" while the bus is down and
// catch up (re-read the tree) the moment it is back, so it keeps one socket it can see: the same
// protocol, with a short capped back-off.

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

export type SocketState = 'connecting' | 'open' | 'closed';

export class EventSocket {
  constructor(
    private settings: ServerConnection.ISettings,
    private onEvent: (event: Record<string, any>) => void,
    private onState: (state: SocketState) => void
  ) {
    this.connect();
  }

  get state(): SocketState {
    return this._state;
  }

  /** Try again now (the reconnect button), instead of waiting for the back-off. */
  retry(): void {
    if (this._state === 'closed' && !this._disposed) {
      window.clearTimeout(this._timer);
      this.connect();
    }
  }

  dispose(): void {
    this._disposed = true;
    window.clearTimeout(this._timer);
    const socket = this._socket;
    this._socket = null;
    if (socket) {
      socket.onclose = null;
      socket.close();
    }
  }

  private connect(): void {
    const { appendToken, token, wsUrl } = this.settings;
    let url = URLExt.join(wsUrl, 'api/events/subscribe');
    if (appendToken && token !== '') {
      url += `?token=${encodeURIComponent(token)}`;
    }
    this.setState('connecting');
    const socket = (this._socket = new this.settings.WebSocket(url));
    socket.onopen = () => {
      this._delay = 250;
      this.setState('open');
    };
    socket.onmessage = (msg: MessageEvent) => {
      if (msg.data) {
        try {
          this.onEvent(JSON.parse(msg.data));
        } catch (err) {
          console.error('forkd: could not read an event', err);
        }
      }
    };
    socket.onclose = () => {
      if (this._disposed) {
        return;
      }
      this._socket = null;
      this.setState('closed');
      this._timer = window.setTimeout(() => this.connect(), this._delay);
      this._delay = Math.min(this._delay * 2, 4000);
    };
  }

  private setState(state: SocketState): void {
    this._state = state;
    this.onState(state);
  }

  private _socket: WebSocket | null = null;
  private _state: SocketState = 'connecting';
  private _delay = 250;
  private _timer = 0;
  private _disposed = false;
}
