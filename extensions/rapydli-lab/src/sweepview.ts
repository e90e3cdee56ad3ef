/**
 * The sweep part of the run view, after optuna-dashboard: summary, trials table (state,
 * parameters, value, steps seen, duration, why the pruner stopped it), best-so-far, intermediate values (what the
 * pruner saw), parallel coordinates and Optuna's parameter importance.
 */
import { CommandRegistry } from '@lumino/commands';

import { ISweepReply, ITrial, requestAPI } from './api';
import { CommandIDs } from './commands';
import { formatNumber, formatShortDuration, h, statusBadge } from './format';
import { formatValue } from './params';
import { layout, parcoords, PendingPlots } from './plots';

/** A log y axis when positive values span more than two decades (a diverged trial). */
function logIfWide(lay: any, values: (number | null)[]): any {
  const v = values.filter((x): x is number => typeof x === 'number' && isFinite(x));
  if (v.length > 1 && Math.min(...v) > 0 && Math.max(...v) / Math.min(...v) > 100) {
    lay.yaxis.type = 'log';
  }
  return lay;
}

function plotDiv(id: string, label: string): HTMLElement {
  return h('div', { className: 'rapydli-Plot', attrs: { 'data-plot': id, 'aria-label': label } });
}

/** Values of completed trials in trial order, and the best value so far at each. */
export function bestSoFar(trials: ITrial[], maximize: boolean): { x: number[]; y: number[]; best: number[] } {
  const x: number[] = [];
  const y: number[] = [];
  const best: number[] = [];
  trials.forEach((t, i) => {
    if (t.state === 'COMPLETE' && typeof t.value === 'number') {
      x.push(i);
      y.push(t.value);
      const previous = best.length ? best[best.length - 1] : t.value;
      best.push(maximize ? Math.max(previous, t.value) : Math.min(previous, t.value));
    }
  });
  return { x, y, best };
}

/** What the pruner compared when it stopped a trial: "step 5: val_loss 2.31 · rung 0 keeps ...". */
export function pruneCell(trial: ITrial): HTMLElement {
  const prune = trial.prune;
  if (!prune) {
    return h('td', { text: trial.state === 'PRUNED' ? 'not recorded' : '', className: 'rapydli-Prune' });
  }
  const value = prune.value === null ? 'not a number' : formatNumber(prune.value);
  return h('td', { className: 'rapydli-Prune', attrs: { title: `${prune.text} (${prune.pruner})` } }, [
    h('span', { className: 'rapydli-Nowrap', text: `step ${prune.step}: ${prune.metric} ${value}` }),
    prune.rule ? h('div', { className: 'rapydli-Meta', text: prune.rule }) : ''
  ]);
}

export async function sweepSection(sweepId: string, commands: CommandRegistry, plots: PendingPlots): Promise<HTMLElement> {
  const reply = await requestAPI<ISweepReply>(`sweeps/${encodeURIComponent(sweepId)}`);
  const metric = reply.metric ?? 'value';
  const maximize = reply.direction === 'maximize';
  const trials = reply.trials;
  const section = h('section', { className: 'rapydli-Trials', attrs: { 'aria-label': 'Trials' } });
  const count = (state: string) => trials.filter(t => t.state === state).length;
  const done = trials.filter(t => t.state === 'COMPLETE' && typeof t.value === 'number');
  const best = done.length
    ? done.reduce((a, b) => ((maximize ? b.value! > a.value! : b.value! < a.value!) ? b : a))
    : null;
  section.append(
    h('h2', { text: `Trials (${trials.length})` }),
    h('p', {
      className: 'rapydli-Summary',
      text:
        `${reply.direction} ${metric} · ${count('COMPLETE')} complete · ${count('PRUNED')} pruned · ${count('FAIL')} failed` +
        (best ? ` · best ${formatNumber(best.value)} (${best.name})` : '')
    })
  );

  // Trials table, with a selection to compare (e.g. the best two).
  const names: string[] = [];
  for (const trial of trials) {
    for (const key of Object.keys(trial.sampled)) {
      if (!names.includes(key)) {
        names.push(key);
      }
    }
  }
  const selected = new Set<string>();
  const compare = h('button', { className: 'jp-mod-styled rapydli-Button', text: 'Compare selected trials', attrs: { type: 'button' } });
  compare.disabled = true;
  compare.addEventListener('click', () => void commands.execute(CommandIDs.openCompare, { ids: [...selected].join(',') }));
  const order = h('select', { attrs: { 'aria-label': 'Order trials' } }, [
    h('option', { text: 'by trial number', attrs: { value: 'number' } }),
    h('option', { text: `best ${metric} first`, attrs: { value: 'best' } })
  ]);
  const table = h('table', { className: 'rapydli-Table', attrs: { 'aria-label': 'Trials table' } });
  const header = h('thead', {}, [
    h('tr', {}, ['', 'trial', 'state', ...names, metric, 'steps', 'duration', 'why pruned'].map(t => h('th', { text: t })))
  ]);
  const body = h('tbody');
  const fill = () => {
    const rows = trials.slice();
    if (order.value === 'best') {
      const key = (t: ITrial) => (typeof t.value === 'number' ? (maximize ? -t.value : t.value) : Infinity);
      rows.sort((a, b) => key(a) - key(b));
    }
    body.replaceChildren(
      ...rows.map(trial => {
        const check = h('input', { attrs: { type: 'checkbox', 'aria-label': `Select ${trial.name} for comparing` } });
        check.checked = selected.has(trial.id);
        check.addEventListener('click', event => {
          event.stopPropagation();
          if (!selected.delete(trial.id)) {
            selected.add(trial.id);
          }
          compare.disabled = selected.size < 2;
        });
        const last = trial.intermediate.length ? trial.intermediate[trial.intermediate.length - 1][0] : null;
        const row = h('tr', {
          className: 'rapydli-ClickRow',
          attrs: { 'data-run-id': trial.id, 'data-state': trial.state, title: `Open ${trial.name}` }
        }, [
          h('td', {}, [check]),
          h('td', { text: trial.name }),
          h('td', { className: 'rapydli-Nowrap' }, [statusBadge(trial.state), ` ${trial.state}`]),
          ...names.map(k => h('td', { text: formatValue(trial.sampled[k]) })),
          h('td', { className: best && trial.id === best.id ? 'rapydli-Best' : '', text: formatNumber(trial.value) }),
          h('td', { text: last === null ? '' : String(last), attrs: { title: 'last step reported to the pruner' } }),
          h('td', { text: formatShortDuration(trial.duration) }),
          pruneCell(trial)
        ]);
        row.addEventListener('click', () => void commands.execute(CommandIDs.openRun, { id: trial.id }));
        return row;
      })
    );
  };
  order.addEventListener('change', fill);
  fill();
  table.append(header, body);
  section.append(h('div', { className: 'rapydli-Controls' }, [order, compare]), h('div', { className: 'rapydli-Wide' }, [table]));

  const grid = h('div', { className: 'rapydli-Grid' });
  section.append(grid);
  // Best so far, with every completed trial's value.
  const history = bestSoFar(trials, maximize);
  if (history.x.length) {
    const div = plotDiv('best-so-far', 'Best so far plot');
    grid.append(div);
    const lay = logIfWide(layout('Best so far', 'trial', metric), history.y);
    lay.xaxis.dtick = 1; // trial numbers
    if (history.x.length === 1) {
      // one complete trial: Plotly would put its dot alone on axes from -1 to 1
      const [x, v] = [history.x[0], history.y[0]];
      const pad = Math.abs(v) * 0.1 || 1;
      lay.xaxis.range = [x - 0.5, x + 0.5];
      lay.xaxis.tickvals = [x];
      lay.yaxis.type = 'linear';
      lay.yaxis.range = [v - pad, v + pad];
      lay.title = { text: 'Best so far (1 complete trial)' };
    }
    plots.add(div, [
      { type: 'scatter', mode: 'markers', name: metric, x: history.x, y: history.y },
      { type: 'scatter', mode: 'lines', name: 'best so far', x: history.x, y: history.best, line: { shape: 'hv' } }
    ], lay);
  }
  // Intermediate values: each trial's reports; pruned ones dashed.
  const curves = trials.filter(t => t.intermediate.length > 0);
  if (curves.length) {
    const div = plotDiv('intermediate', 'Intermediate values plot');
    grid.append(div);
    // where each pruned trial was stopped: the report the pruner judged, its reason on hover
    const decisions = trials.filter(t => t.prune && t.prune.value !== null);
    const pruneMarks = decisions.length
      ? [{
          type: 'scatter',
          mode: 'markers',
          name: 'pruned here',
          x: decisions.map(t => t.prune!.step),
          y: decisions.map(t => t.prune!.value),
          text: decisions.map(t => `${t.name}: ${t.prune!.text}`),
          hoverinfo: 'text',
          marker: { size: 12, symbol: 'x-thin-open', line: { width: 2 }, color: 'black' }
        }]
      : [];
    plots.add(div, [...curves.map(t => ({
      type: 'scatter',
      mode: 'lines+markers',
      name: `${t.name}${t.state === 'PRUNED' ? ' (pruned)' : ''}`,
      x: t.intermediate.map(p => p[0]),
      y: t.intermediate.map(p => p[1]),
      line: t.state === 'PRUNED' ? { dash: 'dot' } : {},
      marker: { size: 4, symbol: t.state === 'PRUNED' ? 'x' : 'circle' }
    })), ...pruneMarks], logIfWide(layout('Intermediate values (what the pruner saw)', 'step', metric), ([] as (number | null)[]).concat(...curves.map(t => t.intermediate.map(p => p[1])))));
  }
  const coords = parcoords(trials.filter(t => t.state === 'COMPLETE'), reply.metric);
  if (coords.length) {
    const div = plotDiv('parcoords', 'Parallel coordinates plot');
    grid.append(div);
    plots.add(div, coords, { title: { text: 'Parallel coordinates (completed trials)' }, height: 340, margin: { l: 60, r: 60, t: 70, b: 30 } });
  }
  if (reply.importance) {
    const entries = Object.entries(reply.importance).reverse();
    const div = plotDiv('importance', 'Parameter importance plot');
    grid.append(div);
    const lay = layout('Parameter importance', 'importance', '');
    lay.margin = { ...lay.margin, l: 100 };
    plots.add(div, [{ type: 'bar', orientation: 'h', x: entries.map(e => e[1]), y: entries.map(e => e[0]), name: 'importance' }], lay);
    section.append(h('p', { className: 'rapydli-Empty', text: reply.importance_basis }));
  } else {
    section.append(h('p', { className: 'rapydli-Empty', attrs: { 'aria-label': 'Parameter importance' }, text: reply.importance_basis }));
  }
  return section;
}
