/**
 * The compare view: several runs' curves overlaid (metric picker, smoothing, x = step or
 * time), the parameters that differ (as `rapydli runs compare` prints) and final metrics
 * side by side; each run's tags can be edited in its column (tag the winner).
 */
import { CommandRegistry } from '@lumino/commands';
import { Widget } from '@lumino/widgets';

import { ICompareReply, requestAPI } from './api';
import { CommandIDs } from './commands';
import { formatNumber, h, shortId } from './format';
import { formatValue, tagEditor } from './params';
import { draw, layout, metricGroup, RANK_SUFFIX, smooth } from './plots';

export class CompareView extends Widget {
  constructor(
    readonly ids: string[],
    private readonly commands: CommandRegistry
  ) {
    super();
    this.addClass('rapydli-View');
    this.addClass('rapydli-CompareView');
    this.title.label = `Compare ${ids.map(shortId).join(', ')}`;
    this.title.closable = true;
    this.node.setAttribute('role', 'region');
    this.node.setAttribute('aria-label', 'Compare runs');
    void this._load();
  }

  private async _load(): Promise<void> {
    try {
      this._data = await requestAPI<ICompareReply>(`compare?ids=${this.ids.map(encodeURIComponent).join(',')}`);
    } catch (error) {
      this.node.replaceChildren(h('div', { className: 'rapydli-Error', text: String((error as Error).message ?? error), attrs: { role: 'alert' } }));
      return;
    }
    this._render();
  }

  /** Column header of a run: name and short id (names often repeat). */
  private _label(id: string): string {
    const run = this._data!.runs.find(r => r.id === id)!;
    return `${run.name} ${shortId(id)}`;
  }

  private _render(): void {
    const data = this._data!;
    const metrics = new Set<string>();
    for (const curves of Object.values(data.curves)) {
      Object.keys(curves).filter(n => !RANK_SUFFIX.test(n)).forEach(n => metrics.add(n));
    }
    const names = [...metrics].sort();
    const preferred = ['val_loss', 'loss'].find(n => metrics.has(n)) ?? names[0] ?? '';
    const picker = h('select', { attrs: { 'aria-label': 'Metric' } }, names.map(n => h('option', { text: n, attrs: { value: n } })));
    picker.value = preferred;
    const slider = h('input', { attrs: { type: 'range', min: '0', max: '0.99', step: '0.01', value: '0', 'aria-label': 'Smoothing' } });
    const sliderValue = h('span', { text: '0' });
    const axis = h('select', { attrs: { 'aria-label': 'X axis' } }, [
      h('option', { text: 'step', attrs: { value: 'step' } }),
      h('option', { text: 'time (s)', attrs: { value: 'time' } })
    ]);
    const plot = h('div', { className: 'rapydli-Plot', attrs: { 'data-plot': 'compare', 'aria-label': 'Compared curves' } });
    const redraw = () => {
      sliderValue.textContent = slider.value;
      void this._plot(plot, picker.value, Number(slider.value), axis.value as 'step' | 'time');
    };
    picker.addEventListener('change', redraw);
    slider.addEventListener('input', redraw);
    axis.addEventListener('change', redraw);

    const heads = ['', ...data.runs.map(r => this._label(r.id))];
    const runRow = h('tr', {}, [
      h('th', { text: 'run' }),
      ...data.runs.map(r => {
        const link = h('a', { text: this._label(r.id), attrs: { href: '#', title: `Open ${r.id}` } });
        link.addEventListener('click', event => {
          event.preventDefault();
          void this.commands.execute(CommandIDs.openRun, { id: r.id });
        });
        return h('th', { attrs: { 'data-run-id': r.id } }, [
          link,
          h('div', { className: 'rapydli-Meta', text: r.status }),
          tagEditor(r.id, r.tags, { compact: true, label: this._label(r.id) })
        ]);
      })
    ]);
    const diff = h('table', { className: 'rapydli-Table', attrs: { 'aria-label': 'Parameters that differ' } }, [
      h('caption', { text: data.params.length ? 'Parameters that differ' : 'Parameters: identical' }),
      h('thead', {}, [runRow])
    ]);
    const diffBody = h('tbody');
    for (const key of data.params) {
      diffBody.append(h('tr', {}, [h('td', { text: key }), ...data.runs.map(r => h('td', { text: formatValue(data.values[r.id]?.[key]) }))]));
    }
    diff.append(diffBody);
    const finals = h('table', { className: 'rapydli-Table', attrs: { 'aria-label': 'Final metrics' } }, [
      h('caption', { text: 'Final metrics' }),
      h('thead', {}, [h('tr', {}, heads.map(t => h('th', { text: t })))])
    ]);
    const finalBody = h('tbody');
    for (const name of data.metrics.filter(n => !RANK_SUFFIX.test(n))) {
      const values = data.runs.map(r => r.final[name]);
      const numbers = values.filter((v): v is number => typeof v === 'number');
      const lower = metricGroup(name) === 'loss' || metricGroup(name) === 'time';
      const differ = numbers.length > 1 && Math.min(...numbers) !== Math.max(...numbers); // a tie has no best
      const best = differ ? (lower ? Math.min(...numbers) : Math.max(...numbers)) : null;
      finalBody.append(h('tr', {}, [
        h('td', { text: name }),
        ...values.map(v => h('td', { className: v === best && !['', 'lr'].includes(metricGroup(name)) ? 'rapydli-Best' : '', text: formatNumber(v) }))
      ]));
    }
    finals.append(finalBody);
    this.node.replaceChildren(
      h('h1', { text: `Compare ${data.runs.length} runs` }),
      h('div', { className: 'rapydli-Controls' }, [
        h('label', { text: 'Metric ' }, [picker]),
        h('label', { text: 'Smoothing ' }, [slider, sliderValue]),
        h('label', { text: 'X ' }, [axis])
      ]),
      plot,
      h('div', { className: 'rapydli-Wide' }, [diff]),
      h('div', { className: 'rapydli-Wide' }, [finals])
    );
    redraw();
  }

  private async _plot(div: HTMLElement, metric: string, weight: number, x: 'step' | 'time'): Promise<void> {
    const data = this._data!;
    const scale = metricGroup(metric) === 'time' ? 1000 : 1;
    const traces = data.runs
      .filter(r => data.curves[r.id]?.[metric])
      .map(r => {
        const points = data.curves[r.id][metric];
        return {
          type: 'scatter',
          mode: 'lines',
          name: this._label(r.id),
          x: points.map(p => (x === 'step' ? p.step : p.time)),
          y: smooth(points.map(p => (p.value === null ? null : p.value * scale)), weight)
        };
      });
    const title = scale === 1000 ? `${metric} (ms)` : metric;
    await draw(div, traces, layout(title, x === 'step' ? 'step' : 'seconds since start', title));
  }

  private _data: ICompareReply | null = null;
}
