/** Plotly figures of the run view (plotly.js is loaded on first use). */
import { IMetricRow, IRun, ITrial } from './api';

let plotlyPromise: Promise<any> | null = null;

export function plotly(): Promise<any> {
  if (plotlyPromise === null) {
    plotlyPromise = import('plotly.js-dist-min').then(m => m.default ?? m);
  }
  return plotlyPromise;
}

/** A plot of the run view: the metrics that share one unit (and so one y axis). */
export interface IUnitGroup {
  id: string;
  title: string;
  yTitle: string;
  /** Multiply values by this (seconds shown as ms). */
  scale: number;
  range?: [number, number];
}

export const UNIT_GROUPS: IUnitGroup[] = [
  { id: 'loss', title: 'Loss', yTitle: 'loss', scale: 1 },
  { id: 'throughput', title: 'Throughput', yTitle: 'samples/s', scale: 1 },
  { id: 'time', title: 'Times', yTitle: 'ms', scale: 1000 },
  { id: 'fraction', title: 'Fractions and accuracy', yTitle: '0–1', scale: 1, range: [0, 1.02] },
  { id: 'lr', title: 'Learning rate', yTitle: 'lr', scale: 1 }
];

/** Per-rank timings plotted rank by rank. */
const PER_RANK = ['step_time_s', 'comm_wait_s'];

/** Per-rank metrics are stored as `name@rankK` (rank 0's under the plain name). */
export const RANK_SUFFIX = /@rank(\d+)$/;

/** The unit a metric is plotted in ('' for a metric of its own unit: it gets its own plot). */
export function metricGroup(name: string): string {
  if (/loss/i.test(name)) {
    return 'loss';
  }
  if (/per_s$|throughput|samples_s|images_s|tokens_s/i.test(name)) {
    return 'throughput';
  }
  if (/(_time|_s|_seconds|_wait)(_s)?$/i.test(name)) {
    return 'time';
  }
  if (/accuracy|acc$|fraction|ratio|efficiency|_frac$/i.test(name)) {
    return 'fraction';
  }
  if (/^lr$|learning_rate/i.test(name)) {
    return 'lr';
  }
  return '';
}

/** Exponential moving average (as TensorBoard smooths): weight 0 = raw values. */
export function smooth(values: (number | null)[], weight: number): (number | null)[] {
  if (weight <= 0) {
    return values.slice();
  }
  let last: number | null = null;
  return values.map(v => {
    if (v === null || !isFinite(v)) {
      return v;
    }
    last = last === null ? v : last * weight + (1 - weight) * v;
    return last;
  });
}

/** Metric series by name: steps and values, in step order (rows of one step in logging order). */
export class MetricSeries {
  readonly series = new Map<string, { x: number[]; y: (number | null)[] }>();

  add(rows: IMetricRow[]): void {
    for (const row of rows) {
      let s = this.series.get(row.name);
      if (!s) {
        s = { x: [], y: [] };
        this.series.set(row.name, s);
      }
      // in step order: a restarted run records the steps its dying engines never sent later, from its checkpoint
      let at = s.x.length;
      while (at > 0 && s.x[at - 1] > row.step) {
        at--;
      }
      s.x.splice(at, 0, row.step);
      s.y.splice(at, 0, row.value);
    }
  }

  /** Names of the run's own metrics (per-rank copies left out), in first-logged order. */
  names(): string[] {
    return [...this.series.keys()].filter(n => !RANK_SUFFIX.test(n));
  }

  /** Traces of one unit group ('' is not a group: use `single`). */
  traces(group: string, scale = 1): any[] {
    return this.names()
      .filter(name => metricGroup(name) === group)
      .map(name => this.single(name, scale));
  }

  single(name: string, scale = 1, label = name): any {
    const s = this.series.get(name)!;
    // Copies: Plotly.react only redraws data whose arrays are new objects.
    return { type: 'scatter', mode: 'lines+markers', name: label, x: s.x.slice(), y: s.y.map(v => (v === null ? null : v * scale)), marker: { size: 4 } };
  }

  /** Step time and communication wait per rank (`base@rankK`): base -> traces for rank 0, 1, ... in ms. */
  perRank(): Map<string, any[]> {
    const out = new Map<string, any[]>();
    for (const name of this.series.keys()) {
      const match = RANK_SUFFIX.exec(name);
      if (!match || !PER_RANK.includes(name.slice(0, match.index))) {
        continue;
      }
      const base = name.slice(0, match.index);
      if (!out.has(base) && this.series.has(base)) {
        out.set(base, [this.single(base, 1000, 'rank 0')]);
      }
      out.get(base)?.push(this.single(name, 1000, `rank ${match[1]}`));
    }
    return out;
  }
}

export function layout(title: string, xTitle: string, yTitle: string): any {
  return {
    title: { text: title },
    xaxis: { title: { text: xTitle } },
    yaxis: { title: { text: yTitle } },
    margin: { l: 60, r: 20, t: 40, b: 50 },
    height: 320,
    // below the x axis title, however many rows it takes (the figure's margin grows to fit)
    legend: { orientation: 'h', y: -0.28, yanchor: 'top' }
  };
}

export async function draw(div: HTMLElement, data: any[], lay: any): Promise<void> {
  const Plotly = await plotly();
  await Plotly.react(div, data, lay, { responsive: true, displaylogo: false });
}

/** Speedup and efficiency by workers, from rows with `workers` and a time or throughput. */
export function scalingTraces(rows: Record<string, any>[]): any[] {
  const usable = rows
    .filter(r => typeof r.workers === 'number')
    .sort((a, b) => a.workers - b.workers);
  if (usable.length === 0) {
    return [];
  }
  const w0 = usable[0].workers;
  let speedup: number[];
  if (usable.every(r => typeof r.speedup === 'number')) {
    speedup = usable.map(r => r.speedup);
  } else if (usable.every(r => typeof r.throughput === 'number')) {
    speedup = usable.map(r => r.throughput / usable[0].throughput);
  } else {
    return [];
  }
  const efficiency = usable.every(r => typeof r.efficiency === 'number')
    ? usable.map(r => r.efficiency)
    : usable.map((r, i) => speedup[i] / (r.workers / w0));
  const workers = usable.map(r => r.workers);
  return [
    { type: 'scatter', mode: 'lines+markers', name: 'speedup', x: workers, y: speedup },
    { type: 'scatter', mode: 'lines', name: 'ideal', x: workers, y: workers.map(w => w / w0), line: { dash: 'dot' } },
    { type: 'scatter', mode: 'lines+markers', name: 'efficiency', x: workers, y: efficiency, yaxis: 'y2' }
  ];
}

/** Scaling rows from child runs: workers = world size, throughput = last throughput metric. */
export function scalingRowsFromChildren(children: IRun[]): Record<string, any>[] {
  const rows: Record<string, any>[] = [];
  for (const child of children) {
    const name = Object.keys(child.final ?? {}).find(k => metricGroup(k) === 'throughput');
    if (name && typeof child.final[name] === 'number') {
      rows.push({ workers: child.world_size, throughput: child.final[name] });
    }
  }
  return rows;
}

/** Parallel coordinates over the numeric parameters of the trials, coloured by the metric. */
export function parcoords(trials: ITrial[], metric: string | null): any[] {
  const done = trials.filter(t => metric && typeof t.final?.[metric] === 'number');
  if (done.length === 0 || !metric) {
    return [];
  }
  const names = Object.keys(done[0].sampled).filter(k => done.every(t => typeof t.sampled[k] === 'number'));
  const dims = names.map(k => ({ label: k, values: done.map(t => t.sampled[k] as number) }));
  const values = done.map(t => t.final[metric] as number);
  dims.push({ label: metric, values });
  return [{ type: 'parcoords', line: { color: values, colorscale: 'Viridis', showscale: true }, dimensions: dims }];
}

/**
 * Plots to draw once their divs are in the page: Plotly sizes a figure from its div, so a
 * view builds its DOM first, attaches it, then runs these.
 */
export class PendingPlots {
  add(div: HTMLElement, data: any[], lay: any): void {
    this._jobs.push(() => draw(div, data, lay));
  }

  async drawAll(): Promise<void> {
    for (const job of this._jobs.splice(0)) {
      await job();
    }
  }

  private _jobs: (() => Promise<void>)[] = [];
}
