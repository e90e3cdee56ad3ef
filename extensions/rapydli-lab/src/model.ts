import { ISignal, Signal } from '@lumino/signaling';

import {
  ICluster,
  IClustersReply,
  IFamiliesReply,
  IFamily,
  ILauncher,
  IWhereReply,
  requestAPI
} from './api';

/** Run filters and order of the panel ('' = any). */
export interface IRunFilter {
  kind: string;
  status: string;
  /** Substring of a name, id, tag or note. */
  text: string;
  sort: string;
  order: 'asc' | 'desc';
}

/** Families per page of the run list. */
export const PAGE_SIZE = 25;

/**
 * What the panel and the status bar show: every cluster, one page of run families,
 * polled from the REST API, the runs picked for comparing, and the last API error
 * (shown in the panel, never swallowed).
 */
export class RapydliModel {
  clusters: ICluster[] = [];
  families: IFamily[] = [];
  totalFamilies = 0;
  offset = 0;
  launchers: ILauncher[] = [];
  filter: IRunFilter = { kind: '', status: '', text: '', sort: 'started', order: 'desc' };
  /** Families shown open (their children listed). */
  readonly expanded = new Set<string>();
  /** Runs ticked for the compare view, in the order ticked. */
  readonly selected: string[] = [];
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

  /** Change filters or order; back to the first page (a filter that changes nothing keeps the page). */
  setFilter(filter: Partial<IRunFilter>): void {
    const next = { ...this.filter, ...filter };
    if ((Object.keys(next) as (keyof IRunFilter)[]).every(key => next[key] === this.filter[key])) {
      return;
    }
    this.filter = next;
    this.offset = 0;
    void this.refresh();
  }

  setPage(offset: number): void {
    this.offset = Math.max(0, offset);
    void this.refresh();
  }

  toggleExpanded(id: string): void {
    if (!this.expanded.delete(id)) {
      this.expanded.add(id);
    }
    this._changed.emit();
  }

  toggleSelected(id: string): void {
    const at = this.selected.indexOf(id);
    if (at >= 0) {
      this.selected.splice(at, 1);
    } else {
      this.selected.push(id);
    }
    this._changed.emit();
  }

  clearSelection(): void {
    this.selected.splice(0);
    this._changed.emit();
  }

  /** Show an action's error in the panel (null dismisses it). */
  setError(error: unknown): void {
    this.actionError = error === null ? null : String((error as Error).message ?? error);
    this._changed.emit();
  }

  async refresh(): Promise<void> {
    const query = new URLSearchParams({
      limit: String(PAGE_SIZE),
      offset: String(this.offset),
      sort: this.filter.sort,
      order: this.filter.order
    });
    for (const key of ['kind', 'status'] as const) {
      if (this.filter[key]) {
        query.set(key, this.filter[key]);
      }
    }
    if (this.filter.text.trim()) {
      query.set('q', this.filter.text.trim());
    }
    const serial = ++this._serial;
    try {
      const [clusters, families] = await Promise.all([
        requestAPI<IClustersReply>('clusters'),
        requestAPI<IFamiliesReply>(`families?${query}`)
      ]);
      await this.loadLaunchers();
      if (serial !== this._serial) {
        return; // a newer refresh (other filters) is under way
      }
      this.clusters = clusters.clusters;
      this.families = families.families;
      this.totalFamilies = families.total;
      this.pollError = null;
    } catch (error) {
      this.pollError = String((error as Error).message ?? error);
    }
    this._changed.emit();
  }

  /**
   * The launchers the server offers: fetched once (again after a failure), and awaited by
   * whoever needs them, so a Start dialog opened before the first refresh has answered
   * still offers every launcher, not only the local fallback.
   */
  async loadLaunchers(): Promise<ILauncher[]> {
    if (this.launchers.length) {
      return this.launchers;
    }
    if (!this._launchersLoading) {
      this._launchersLoading = requestAPI<{ launchers: ILauncher[] }>('launchers')
        .then(reply => (this.launchers = reply.launchers))
        .finally(() => {
          this._launchersLoading = null;
        });
    }
    return this._launchersLoading;
  }

  async startCluster(n: number, launcher: string, options: Record<string, unknown> = {}): Promise<ICluster | null> {
    return this._act(() =>
      requestAPI<ICluster>('clusters', { method: 'POST', body: JSON.stringify({ n, launcher, options }) })
    );
  }

  async restartCluster(id: string): Promise<ICluster | null> {
    return this._act(() => requestAPI<ICluster>(`clusters/${encodeURIComponent(id)}/restart`, { method: 'POST' }));
  }

  /** Where every rank of a cluster stands (null, with the panel's error set, when it cannot be asked). */
  async whereCluster(id: string): Promise<IWhereReply | null> {
    try {
      const reply = await requestAPI<IWhereReply>(`clusters/${encodeURIComponent(id)}/where`);
      this.actionError = null;
      return reply;
    } catch (error) {
      this.setError(error);
      return null;
    }
  }

  /** Ask the server to stop a cluster: it answers at once and the row shows "stopping". */
  async stopCluster(id: string): Promise<ICluster | null> {
    return this._act(() => requestAPI<ICluster>(`clusters/${encodeURIComponent(id)}`, { method: 'DELETE' }));
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
  private _serial = 0;
  private _launchersLoading: Promise<ILauncher[]> | null = null;
}
