import { CommandRegistry } from '@lumino/commands';
import { Widget } from '@lumino/widgets';

import { IMetricsReply, IRunDetail, ITrackerLink, requestAPI } from './api';
import { artifactList, batchSection } from './batchview';
import { formatDuration, formatNumber, h, shortId } from './format';
import { annotationsEditor, kvTable, paramsTable } from './params';
import {
  draw,
  layout,
  metricGroup,
  MetricSeries,
  scalingRowsFromChildren,
  scalingTraces,
  PendingPlots,
  UNIT_GROUPS
} from './plots';
import { sourceSection } from './sources';
import { sweepSection } from './sweepview';

/** The tab title of a run: kind, name and short id, so two runs never share one. */
export function runTitle(run: { kind: string; name: string; id: string }): string {
  return `${run.kind}: ${run.name} · ${shortId(run.id)}`;
}

/**
 * The run view in the main area: tags and note, run facts (hosts included), parameters
 * (nested config expanded; the recorded code is not a parameter), the run's source (its
 * notebook code and the module functions it names), one plot per unit (loss; throughput; times in ms; fractions
 * 0-1; learning rate; any other metric alone), per-rank timings where recorded, the run in
 * its trackers (MLflow, TensorBoard, W&B), artifacts;
 * for scaling runs the speedup/efficiency plot, for sweeps the sweep view, for batches the
 * items table. Polls `metrics?since=` while the run is running and stops when it ends.
 */
export class RunView extends Widget {
  constructor(
    readonly runId: string,
    private readonly commands: CommandRegistry,
    private readonly pollMs = 1500
  ) {
    super();
    this.id = `rapydli-run-${runId}`;
    this.addClass('rapydli-RunView');
    this.addClass('rapydli-View');
    this.title.label = `Run ${runId}`;
    this.title.closable = true;
    this.node.setAttribute('role', 'region');
    this.node.setAttribute('aria-label', `Run ${runId}`);
    this._header = h('div', { className: 'rapydli-RunHeader' });
    this._error = h('div', { className: 'rapydli-Error', attrs: { role: 'alert' } });
    this._error.hidden = true;
    this._plots = h('div', { className: 'rapydli-Grid' });
    this._extra = h('div', { className: 'rapydli-RunExtra' });
    this._details = h('div', { className: 'rapydli-RunDetails' });
    this.node.append(this._header, this._error, this._extra, this._plots, this._details);
    void this._load();
  }

  /** True while the view polls for new metrics. */
  get polling(): boolean {
    return this._timer !== null;
  }

  dispose(): void {
    this._stopPolling();
    super.dispose();
  }

  private _showError(error: unknown): void {
    this._error.textContent = String((error as Error).message ?? error);
    this._error.hidden = false;
  }

  private async _load(): Promise<void> {
    try {
      this._run = await requestAPI<IRunDetail>(`runs/${encodeURIComponent(this.runId)}`);
      this.title.label = runTitle(this._run);
      this._status = this._run.status;
      this._renderHeader();
      await this._renderExtra();
      await this._poll();
      if (this._status === 'running') {
        this._timer = window.setInterval(() => void this._poll(), this.pollMs);
      }
    } catch (error) {
      this._showError(error);
    }
  }

  private _stopPolling(): void {
    if (this._timer !== null) {
      window.clearInterval(this._timer);
      this._timer = null;
    }
  }

  private async _poll(): Promise<void> {
    if (this._busy) {
      return;
    }
    this._busy = true;
    try {
      const reply = await requestAPI<IMetricsReply>(
        `runs/${encodeURIComponent(this.runId)}/metrics?since=${this._cursor}`
      );
      this._cursor = reply.cursor;
      this._series.add(reply.metrics);
      const ended = this._status === 'running' && reply.status !== 'running';
      this._status = reply.status;
      this.node.dataset.status = reply.status;
      let restarted = false;
      if (reply.status === 'running' && this._run && Date.now() - this._detailAt > DETAIL_EVERY_MS) {
        // a restart is recorded while the run goes on: its record is read again every few seconds
        this._detailAt = Date.now();
        const before = this._run.records?.restarts?.value?.length ?? 0;
        const found = stragglersOf(this._run).length + (this._run.records?.hang ? 1 : 0);
        this._run = await requestAPI<IRunDetail>(`runs/${encodeURIComponent(this.runId)}`);
        restarted = (this._run.records?.restarts?.value?.length ?? 0) !== before;
        if (stragglersOf(this._run).length + (this._run.records?.hang ? 1 : 0) !== found) {
          this._renderHeader(); // a straggler or a hang found while it runs: said at once
          restarted = true; // and the per-rank plots redrawn with it marked
        }
      }
      if (reply.metrics.length > 0 || this._drawn === false || restarted) {
        await this._drawMetrics();
      }
      if (ended || (this._status !== 'running' && this._timer !== null)) {
        this._stopPolling();
        this._run = await requestAPI<IRunDetail>(`runs/${encodeURIComponent(this.runId)}`);
        this._renderHeader();
        await this._renderExtra();
        await this._drawMetrics(); // with the records it ended with (its restarts)
      }
      this._error.hidden = true;
    } catch (error) {
      this._showError(error);
    } finally {
      this._busy = false;
    }
  }

  /** The plot div for `key`, created (in order of first use) when first needed. */
  private _plotDiv(key: string, label: string): HTMLElement {
    let div = this._plotDivs.get(key);
    if (!div) {
      div = h('div', { className: 'rapydli-Plot', attrs: { 'data-plot': key, 'aria-label': label } });
      this._plotDivs.set(key, div);
      this._plots.append(div);
    }
    return div;
  }

  private async _drawMetrics(): Promise<void> {
    if (this._run?.kind === 'sweep') {
      return; // a sweep logs its metric by trial number: the sweep view plots it (best so far)
    }
    for (const group of UNIT_GROUPS) {
      const traces = this._series.traces(group.id, group.scale);
      if (traces.length > 0) {
        const lay = layout(group.title, 'step', group.yTitle);
        if (group.range) {
          lay.yaxis.range = group.range;
        }
        if (group.id === 'loss') {
          lay.shapes = restartLines(this._run?.records?.restarts?.value);
        }
        await draw(this._plotDiv(group.id, `${group.title} plot`), traces, lay);
      }
    }
    for (const name of this._series.names().filter(n => metricGroup(n) === '')) {
      await draw(this._plotDiv(`metric-${name}`, `${name} plot`), [this._series.single(name)], layout(name, 'step', name));
    }
    const slow = new Set(stragglersOf(this._run).map(s => s.rank));
    for (const [base, traces] of this._series.perRank()) {
      const title = `Per rank: ${base.replace(/_s$/, '')} (ms)`;
      for (const trace of traces) {
        const rank = /^rank (\d+)$/.exec(trace.name);
        if (rank && slow.has(Number(rank[1]))) {
          // the straggler stands out: bold and red, named so
          trace.name = `rank ${rank[1]} (straggler)`;
          trace.line = { color: STRAGGLER_COLOR, width: 3 };
          trace.marker = { ...trace.marker, color: STRAGGLER_COLOR };
        }
      }
      await draw(this._plotDiv(`rank-${base}`, `${title} plot`), traces, layout(title, 'step', 'ms'));
    }
    this._drawn = true;
  }

  private _renderHeader(): void {
    const run = this._run!;
    const rows: [string, string][] = [
      ['id', run.id],
      ['kind', run.kind],
      ['status', run.status],
      ['world size', String(run.world_size)],
      ['seed', run.seed === null ? '' : String(run.seed)],
      ['started', new Date(run.started * 1000).toLocaleString()],
      ['duration', formatDuration(run.duration, run.status === 'running' ? run.started : undefined)],
      ['hosts', (run.hosts ?? [run.host]).join(', ')]
    ];
    const parent = run.parent;
    const parentLink = h('a', { text: parent ? `part of ${shortId(parent)}` : '', attrs: { href: '#' } });
    parentLink.addEventListener('click', event => {
      event.preventDefault();
      if (parent) {
        void this.commands.execute('rapydli:open-run', { id: parent });
      }
    });
    this._header.replaceChildren(
      h('h1', { text: `${run.kind} run “${run.name}”` }),
      h('span', { className: `rapydli-Badge rapydli-status-${run.status}`, text: run.status, attrs: { 'aria-label': 'Run status' } }),
      h('span', { text: ' ' }),
      parent ? parentLink : h('span'),
      run.error ? h('pre', { className: 'rapydli-Error', text: run.error }) : h('span'),
      ...stragglersOf(run).map(s =>
        h('p', { className: 'rapydli-Straggler', text: s.text ?? `rank ${s.rank} is a straggler`, attrs: { 'aria-label': 'Straggler' } })
      ),
      ...(run.records?.hang?.value?.diagnosis
        ? [h('pre', { className: 'rapydli-Error', text: `hang: ${run.records.hang.value.diagnosis}`, attrs: { 'aria-label': 'Hang diagnosis' } })]
        : []),
      annotationsEditor(run.id, run.tags ?? [], run.note ?? null)
    );
    const params = { ...(run.params ?? {}) };
    delete params['sources']; // notebook code: shown in the Source section
    const source = sourceSection(run.sources ?? []);
    this._details.replaceChildren(
      h('div', { className: 'rapydli-Columns' }, [
        kvTable('Run', rows),
        paramsTable(params),
        kvTable('Final metrics', Object.entries(run.final ?? {}).filter(([k]) => !k.includes('@rank')).map(([k, v]) => [k, formatNumber(v)]))
      ]),
      ...(run.trackers?.length ? [trackerList(run.trackers)] : []),
      ...(source ? [source] : []),
      artifactList(this.commands, run.id, run.artifacts)
    );
  }

  private async _renderExtra(): Promise<void> {
    const run = this._run!;
    const parts: HTMLElement[] = [];
    const plots = new PendingPlots();
    if (run.kind === 'scaling') {
      parts.push(await this._scaling(run, plots));
    }
    if (run.kind === 'sweep') {
      parts.push(await sweepSection(run.id, this.commands, plots));
    }
    if (run.kind === 'batch' && !run.parent) {
      parts.push(await batchSection(run.id, this.commands));
    }
    for (const [name, record] of Object.entries(run.records ?? {})) {
      if (record.type === 'figure' && record.value && Array.isArray(record.value.data)) {
        const div = h('div', { className: 'rapydli-Plot', attrs: { 'data-plot': `record-${name}`, 'aria-label': `Figure ${name}` } });
        parts.push(div);
        plots.add(div, record.value.data, record.value.layout ?? { title: { text: name } });
      }
    }
    this._extra.replaceChildren(...parts);
    await plots.drawAll();
  }

  private async _scaling(run: IRunDetail, plots: PendingPlots): Promise<HTMLElement> {
    let rows: Record<string, any>[] = [];
    for (const record of Object.values(run.records ?? {})) {
      if (record.type === 'table' && Array.isArray(record.value) && record.value.some((r: any) => 'workers' in r)) {
        rows = record.value;
      }
    }
    if (rows.length === 0) {
      rows = scalingRowsFromChildren(run.children);
    }
    const div = h('div', { className: 'rapydli-Plot', attrs: { 'data-plot': 'scaling', 'aria-label': 'Speedup and efficiency plot' } });
    const traces = scalingTraces(rows);
    if (traces.length === 0) {
      return h('p', { className: 'rapydli-Empty', text: 'No scaling measurements yet.' });
    }
    const lay = layout('Speedup and efficiency', 'workers', 'speedup');
    lay.yaxis2 = { title: { text: 'efficiency' }, overlaying: 'y', side: 'right', range: [0, 1.1] };
    lay.margin = { ...lay.margin, r: 70 };
    plots.add(div, traces, lay);
    return div;
  }

  private _run: IRunDetail | null = null;
  private _status = 'running';
  private _cursor = -1;
  private _busy = false;
  private _drawn = false;
  private _detailAt = Date.now();
  private _timer: number | null = null;
  private _series = new MetricSeries();
  private _header: HTMLElement;
  private _error: HTMLElement;
  private _plots: HTMLElement;
  private _plotDivs = new Map<string, HTMLElement>();
  private _extra: HTMLElement;
  private _details: HTMLElement;
}

/**
 * The run in its trackers: a link that opens the tracker's page in a new tab (MLflow, online
 * W&B), or the folder to point the tracker at (TensorBoard's log dir, an offline W&B run).
 */
function trackerList(trackers: ITrackerLink[]): HTMLElement {
  const list = h('ul');
  for (const link of trackers) {
    const where = link.url
      ? h('a', { text: link.url, attrs: { href: link.url, target: '_blank', rel: 'noopener noreferrer', 'aria-label': `Open in ${link.tracker}` } })
      : h('code', { text: link.path ?? link.id });
    list.append(h('li', { attrs: { 'data-tracker': link.tracker } }, [h('span', { text: `${link.tracker}: ` }), where]));
  }
  return h('section', { className: 'rapydli-Trackers', attrs: { 'aria-label': 'Trackers' } }, [h('h2', { text: 'Trackers' }), list]);
}

/** How often a running run's records (its restarts, stragglers, a hang) are read again. */
const DETAIL_EVERY_MS = 5000;

const STRAGGLER_COLOR = '#d62728';

/** The ranks a run found persistently slower than the others (its `stragglers` record). */
function stragglersOf(run: IRunDetail | null | undefined): { rank: number; host?: string; text?: string }[] {
  const value = run?.records?.stragglers?.value;
  return Array.isArray(value) ? value : [];
}

/** Dashed red lines at the steps a restarted run resumed from (its `restarts` record), labelled "restart". */
function restartLines(restarts: { resumed_from_step?: number | null; cause?: string }[] | undefined): any[] {
  return (restarts ?? []).map(restart => ({
    type: 'line',
    x0: restart.resumed_from_step ?? 0,
    x1: restart.resumed_from_step ?? 0,
    xref: 'x',
    y0: 0,
    y1: 1,
    yref: 'paper',
    line: { dash: 'dash', color: '#d62728' },
    name: 'restart'
  }));
}
