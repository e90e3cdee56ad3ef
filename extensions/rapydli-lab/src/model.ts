import { ISignal, Signal } from '@lumino/signaling';

import {
  ICluster,
  IClustersReply,
  ILauncher,
  IRun,
  IRunsReply,
  requestAPI
} from './api';

/** Run filters of the panel ('' = any). */
export interface IRunFilter {
  kind: string;
  status: string;
}

/**
 * What the panel and the status bar show: clusters, latest runs and sweeps, polled from
 * the REST API, plus the last API error (shown in the panel, never swallowed).
 */
export class RapydliModel {
  clusters: ICluster[] = [];
  runs: IRun[] = [];
  totalRuns = 0;
  sweeps: IRun[] = [];
  launchers: ILauncher[] = [];
  filter: IRunFilter = { kind: '', status: '' };
  /** The last polling error (cleared by the next successful poll). */
  pollError: string | null = null;
  /** The last error of an action (start, stop, ...); stays until dismissed or the next action succeeds. */
  actionError: string | null = null;

  constructor(readonly pollMs = 2000) {}

  get changed(): ISignal<this, void> {
    return this._changed;
  }

  /** Number of live engines over all clusters. */
  get enginesAlive(): number {
    return this.clusters.reduce((sum, c) => sum + c.engines_alive, 0);
  }

  start(): void {
    if (this._timer === null) {
      void this.refresh();
      this._timer = window.setInterval(() => void this.refresh(), this.pollMs);
    }
  }

  dispose(): void {
    if (this._timer !== null) {
      window.clearInterval(this._timer);
      this._timer = null;
    }
  }

  setFilter(filter: Partial<IRunFilter>): void {
    this.filter = { ...this.filter, ...filter };
    void this.refresh();
  }

  /** Show an action's error in the panel (null dismisses it). */
  setError(error: unknown): void {
    this.actionError = error === null ? null : String((error as Error).message ?? error);
    this._changed.emit();
  }

  async refresh(): Promise<void> {
    const query = new URLSearchParams({ limit: '50' });
    if (this.filter.kind) {
      query.set('kind', this.filter.kind);
    }
    if (this.filter.status) {
      query.set('status', this.filter.status);
    }
    try {
      const [clusters, runs, sweeps] = await Promise.all([
        requestAPI<IClustersReply>('clusters'),
        requestAPI<IRunsReply>(`runs?${query}`),
        requestAPI<IRunsReply>('runs?kind=sweep&limit=20')
      ]);
      if (this.launchers.length === 0) {
        this.launchers = (
          await requestAPI<{ launchers: ILauncher[] }>('launchers')
        ).launchers;
      }
      this.clusters = clusters.clusters;
      this.runs = runs.runs;
      this.totalRuns = runs.total;
      this.sweeps = sweeps.runs;
      this.pollError = null;
    } catch (error) {
      this.pollError = String((error as Error).message ?? error);
    }
    this._changed.emit();
  }

  async startCluster(
    n: number,
    launcher: string,
    options: Record<string, unknown> = {}
  ): Promise<ICluster | null> {
    return this._act(() =>
      requestAPI<ICluster>('clusters', {
        method: 'POST',
        body: JSON.stringify({ n, launcher, options })
      })
    );
  }

  async restartCluster(id: string): Promise<ICluster | null> {
    return this._act(() =>
      requestAPI<ICluster>(`clusters/${encodeURIComponent(id)}/restart`, {
        method: 'POST'
      })
    );
  }

  async stopCluster(id: string): Promise<ICluster | null> {
    return this._act(() =>
      requestAPI<ICluster>(`clusters/${encodeURIComponent(id)}`, {
        method: 'DELETE'
      })
    );
  }

  private async _act(fn: () => Promise<ICluster>): Promise<ICluster | null> {
    try {
      const result = await fn();
      this.actionError = null;
      await this.refresh();
      return result;
    } catch (error) {
      this.setError(error);
      return null;
    }
  }

  private _changed = new Signal<this, void>(this);
  private _timer: number | null = null;
}
