import { PageConfig } from '@jupyterlab/coreutils';
import { CommandRegistry } from '@lumino/commands';
import { Widget } from '@lumino/widgets';

import { IMetricsReply, IRunDetail, ISweepReply, requestAPI } from './api';
import { formatDuration, formatNumber, h } from './format';
import {
  draw,
  layout,
  MetricSeries,
  parcoords,
  scalingRowsFromChildren,
  scalingTraces
} from './plots';

/**
 * The run view in the main area: parameters, live loss/throughput plots, artifacts; for
 * scaling runs the speedup/efficiency plot, for sweeps the trials table and parallel
 * coordinates. Polls `metrics?since=` while the run is running and stops when it ends.
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
    this.title.label = `Run ${runId}`;
    this.title.closable = true;
    this.node.setAttribute('role', 'region');
    this.node.setAttribute('aria-label', `Run ${runId}`);
    this._header = h('div', { className: 'rapydli-RunHeader' });
    this._error = h('div', { className: 'rapydli-Error', attrs: { role: 'alert' } });
    this._error.hidden = true;
    this._lossPlot = h('div', { className: 'rapydli-Plot', attrs: { 'data-plot': 'loss', 'aria-label': 'Loss plot' } });
    this._throughputPlot = h('div', { className: 'rapydli-Plot', attrs: { 'data-plot': 'throughput', 'aria-label': 'Throughput plot' } });
    this._otherPlot = h('div', { className: 'rapydli-Plot', attrs: { 'data-plot': 'other', 'aria-label': 'Other metrics plot' } });
    this._extra = h('div', { className: 'rapydli-RunExtra' });
    this.node.append(this._header, this._error, this._lossPlot, this._throughputPlot, this._otherPlot, this._extra);
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
      this.title.label = `${this._run.kind}: ${this._run.name}`;
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
      if (reply.metrics.length > 0 || this._drawn === false) {
        await this._drawMetrics();
      }
      if (ended || (this._status !== 'running' && this._timer !== null)) {
        this._stopPolling();
        this._run = await requestAPI<IRunDetail>(`runs/${encodeURIComponent(this.runId)}`);
        this._renderHeader();
        await this._renderExtra();
      }
      this._error.hidden = true;
    } catch (error) {
      this._showError(error);
    } finally {
      this._busy = false;
    }
  }

  private async _drawMetrics(): Promise<void> {
    const groups: [HTMLElement, string, string, string][] = [
      [this._lossPlot, 'loss', 'Loss', 'loss'],
      [this._throughputPlot, 'throughput', 'Throughput', 'samples/s'],
      [this._otherPlot, 'other', 'Other metrics', 'value']
    ];
    for (const [div, group, title, yTitle] of groups) {
      const traces = this._series.traces(group);
      div.hidden = traces.length === 0;
      if (!div.hidden) {
        await draw(div, traces, layout(title, 'step', yTitle));
      }
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
      ['host', run.host]
    ];
    const params = Object.entries(run.params ?? {}).map(([k, v]) => [k, typeof v === 'object' ? JSON.stringify(v) : formatNumber(v)]);
    this._header.replaceChildren(
      h('h1', { text: `${run.kind} run “${run.name}”` }),
      h('span', { className: `rapydli-Badge rapydli-status-${run.status}`, text: run.status, attrs: { 'aria-label': 'Run status' } }),
      run.error ? h('pre', { className: 'rapydli-Error', text: run.error }) : h('span'),
      h('div', { className: 'rapydli-Columns' }, [
        this._table('Run', rows),
        this._table('Parameters', params as [string, string][]),
        this._table('Final metrics', Object.entries(run.final ?? {}).map(([k, v]) => [k, formatNumber(v)]))
      ]),
      this._artifacts()
    );
  }

  private _table(caption: string, rows: [string, string][]): HTMLElement {
    const table = h('table', { className: 'rapydli-Table rapydli-KV', attrs: { 'aria-label': caption } }, [h('caption', { text: caption })]);
    for (const [k, v] of rows) {
      table.append(h('tr', {}, [h('th', { text: k }), h('td', { text: v })]));
    }
    return table;
  }

  private _artifacts(): HTMLElement {
    const run = this._run!;
    const section = h('section', { className: 'rapydli-Artifacts', attrs: { 'aria-label': 'Artifacts' } }, [h('h2', { text: 'Artifacts' })]);
    if (run.artifacts.length === 0) {
      section.append(h('p', { className: 'rapydli-Empty', text: 'No artifacts.' }));
      return section;
    }
    const root = PageConfig.getOption('serverRoot').replace(/\/$/, '');
    const list = h('ul');
    for (const artifact of run.artifacts) {
      const inside = root && artifact.path.startsWith(root + '/');
      const item = h('li', {}, [h('span', { text: `${artifact.kind}: ` })]);
      if (inside) {
        const path = artifact.path.slice(root.length + 1);
        const link = h('a', { text: path, attrs: { href: '#', title: `Open ${path}` } });
        link.addEventListener('click', event => {
          event.preventDefault();
          void this.commands.execute('docmanager:open', { path });
        });
        item.append(link);
      } else {
        item.append(h('code', { text: artifact.path }));
      }
      list.append(item);
    }
    section.append(list);
    return section;
  }

  private async _renderExtra(): Promise<void> {
    const run = this._run!;
    const parts: HTMLElement[] = [];
    if (run.kind === 'scaling') {
      parts.push(await this._scaling(run));
    }
    if (run.kind === 'sweep') {
      parts.push(await this._sweep());
    }
    for (const [name, record] of Object.entries(run.records ?? {})) {
      if (record.type === 'figure' && record.value && Array.isArray(record.value.data)) {
        const div = h('div', { className: 'rapydli-Plot', attrs: { 'data-plot': `record-${name}`, 'aria-label': `Figure ${name}` } });
        parts.push(div);
        void draw(div, record.value.data, record.value.layout ?? { title: { text: name } });
      }
    }
    this._extra.replaceChildren(...parts);
  }

  private async _scaling(run: IRunDetail): Promise<HTMLElement> {
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
    await draw(div, traces, lay);
    return div;
  }

  private async _sweep(): Promise<HTMLElement> {
    const reply = await requestAPI<ISweepReply>(`sweeps/${encodeURIComponent(this.runId)}`);
    const metric = reply.metric ?? Object.keys(reply.trials[0]?.final ?? {})[0] ?? null;
    const section = h('section', { className: 'rapydli-Trials', attrs: { 'aria-label': 'Trials' } }, [h('h2', { text: `Trials (${reply.trials.length})` })]);
    const paramNames: string[] = [];
    for (const trial of reply.trials) {
      for (const key of Object.keys(trial.sampled)) {
        if (!paramNames.includes(key)) {
          paramNames.push(key);
        }
      }
    }
    const table = h('table', { className: 'rapydli-Table', attrs: { 'aria-label': 'Trials table' } }, [
      h('thead', {}, [h('tr', {}, ['trial', 'state', ...paramNames, metric ?? 'metric'].map(t => h('th', { text: t })))])
    ]);
    const body = h('tbody');
    for (const trial of reply.trials) {
      const row = h('tr', { attrs: { 'data-run-id': trial.id } }, [
        h('td', { text: trial.name }),
        h('td', { text: trial.state }),
        ...paramNames.map(k => h('td', { text: formatNumber(trial.sampled[k]) })),
        h('td', { text: metric ? formatNumber(trial.final?.[metric]) : '' })
      ]);
      body.append(row);
    }
    table.append(body);
    section.append(table);
    const traces = parcoords(reply.trials, metric);
    if (traces.length > 0) {
      const div = h('div', { className: 'rapydli-Plot', attrs: { 'data-plot': 'parcoords', 'aria-label': 'Parallel coordinates plot' } });
      section.append(div);
      await draw(div, traces, { title: { text: 'Trials' }, height: 360, margin: { l: 60, r: 60, t: 60, b: 30 } });
    }
    return section;
  }

  private _run: IRunDetail | null = null;
  private _status = 'running';
  private _cursor = -1;
  private _busy = false;
  private _drawn = false;
  private _timer: number | null = null;
  private _series = new MetricSeries();
  private _header: HTMLElement;
  private _error: HTMLElement;
  private _lossPlot: HTMLElement;
  private _throughputPlot: HTMLElement;
  private _otherPlot: HTMLElement;
  private _extra: HTMLElement;
}
