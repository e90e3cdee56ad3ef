/** Plotly figures of the run view (plotly.js is loaded on first use). */
import { IMetricRow, IRun, ITrial } from './api';

let plotlyPromise: Promise<any> | null = null;

export function plotly(): Promise<any> {
  if (plotlyPromise === null) {
    plotlyPromise = import('plotly.js-dist-min').then(m => m.default ?? m);
  }
  return plotlyPromise;
}

const LOSS = /loss/i;
const THROUGHPUT = /throughput|per_s|_s$|samples|images|tokens/i;

/** Which plot a metric belongs to. */
export function metricGroup(name: string): 'loss' | 'throughput' | 'other' {
  if (LOSS.test(name)) {
    return 'loss';
  }
  if (THROUGHPUT.test(name)) {
    return 'throughput';
  }
  return 'other';
}

/** Metric series by name: steps and values, in logging order. */
export class MetricSeries {
  readonly series = new Map<string, { x: number[]; y: (number | null)[] }>();

  add(rows: IMetricRow[]): void {
    for (const row of rows) {
      let s = this.series.get(row.name);
      if (!s) {
        s = { x: [], y: [] };
        this.series.set(row.name, s);
      }
      s.x.push(row.step);
      s.y.push(row.value);
    }
  }

  traces(group: string): any[] {
    const out: any[] = [];
    for (const [name, s] of this.series) {
      if (metricGroup(name) === group) {
        // Copies: Plotly.react only redraws data whose arrays are new objects.
        out.push({ type: 'scatter', mode: 'lines+markers', name, x: s.x.slice(), y: s.y.slice(), marker: { size: 4 } });
      }
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
    legend: { orientation: 'h' }
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
