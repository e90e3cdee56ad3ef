import { CommandRegistry } from '@lumino/commands';
import { Widget } from '@lumino/widgets';

import { ICluster, IRun } from './api';
import { CommandIDs } from './commands';
import { formatDuration, formatNumber, h, keyMetric } from './format';
import { RapydliModel } from './model';

const KINDS = ['train', 'sweep', 'trial', 'scaling', 'batch', 'tune'];
const STATUSES = ['running', 'finished', 'failed', 'interrupted'];

/**
 * The left side panel: Clusters, Runs and Sweeps, re-rendered whenever the model polls.
 */
export class RapydliPanel extends Widget {
  constructor(
    private readonly model: RapydliModel,
    private readonly commands: CommandRegistry
  ) {
    super();
    this.id = 'rapydli-panel';
    this.addClass('rapydli-Panel');
    this.title.caption = 'RaPyDLI';
    this.node.setAttribute('role', 'region');
    this.node.setAttribute('aria-label', 'RaPyDLI');
    model.changed.connect(this._render, this);
    this._render();
  }

  dispose(): void {
    this.model.changed.disconnect(this._render, this);
    super.dispose();
  }

  private _render(): void {
    const model = this.model;
    const root = h('div', { className: 'rapydli-Panel-content' }, [
      h('h1', { className: 'rapydli-Panel-title', text: 'RaPyDLI' })
    ]);
    if (model.pollError) {
      root.append(h('div', { className: 'rapydli-Error', text: model.pollError, attrs: { role: 'alert' } }));
    }
    if (model.actionError) {
      const dismiss = h('button', {
        className: 'rapydli-Dismiss',
        text: '×',
        attrs: { type: 'button', 'aria-label': 'Dismiss error', title: 'Dismiss' }
      });
      dismiss.addEventListener('click', () => model.setError(null));
      root.append(h('div', { className: 'rapydli-Error', attrs: { role: 'alert' } }, [dismiss, model.actionError]));
    }
    root.append(this._clusters(model.clusters));
    root.append(this._runs(model.runs, model.totalRuns));
    root.append(this._sweeps(model.sweeps));
    this.node.replaceChildren(root);
  }

  private _button(
    label: string,
    command: string,
    args: Record<string, string> = {},
    title = label
  ): HTMLButtonElement {
    const button = h('button', {
      className: 'jp-mod-styled rapydli-Button',
      text: label,
      attrs: { type: 'button', title, 'aria-label': title }
    });
    button.addEventListener('click', () => {
      void this.commands.execute(command, args);
    });
    return button;
  }

  private _clusters(clusters: ICluster[]): HTMLElement {
    const section = h('section', {
      className: 'rapydli-Section',
      attrs: { 'aria-label': 'Clusters' }
    });
    section.append(
      h('h2', { text: 'Clusters' }),
      h('div', { className: 'rapydli-Toolbar' }, [
        this._button('Start…', CommandIDs.startCluster, {}, 'Start cluster'),
        this._button(
          'Insert %%distributed cell',
          CommandIDs.insertDistributedCell,
          {},
          'Insert %%distributed cell'
        )
      ])
    );
    if (clusters.length === 0) {
      section.append(h('p', { className: 'rapydli-Empty', text: 'No cluster started from this server.' }));
      return section;
    }
    const list = h('ul', { className: 'rapydli-List', attrs: { 'aria-label': 'Cluster list' } });
    for (const cluster of clusters) {
      const item = h('li', {
        className: `rapydli-Cluster rapydli-state-${cluster.state}`,
        attrs: { 'data-cluster-id': cluster.id }
      });
      item.append(
        h('div', { className: 'rapydli-Row' }, [
          h('strong', { text: cluster.id }),
          h('span', { text: ` ${cluster.launcher} · ` }),
          h('span', {
            className: 'rapydli-Engines',
            text: `${cluster.engines_alive}/${cluster.n} engines`
          }),
          h('span', { text: ' · ' }),
          h('span', { className: 'rapydli-State', text: cluster.state })
        ])
      );
      if (cluster.job) {
        const { id, state, reason, nodes } = cluster.job;
        const why = reason && reason !== 'None' ? ` (${reason})` : '';
        const where = nodes ? ` on ${nodes}` : '';
        item.append(h('div', { className: 'rapydli-Job', text: `job ${id}: ${state}${why}${where}` }));
      }
      if (cluster.error) {
        item.append(h('div', { className: 'rapydli-Error', text: cluster.error }));
      }
      item.append(
        h('div', { className: 'rapydli-Toolbar' }, [
          this._button('Restart', CommandIDs.restartCluster, { id: cluster.id }, `Restart cluster ${cluster.id}`),
          this._button('Stop', CommandIDs.stopCluster, { id: cluster.id }, `Stop cluster ${cluster.id}`)
        ])
      );
      list.append(item);
    }
    section.append(list);
    return section;
  }

  private _select(label: string, values: string[], current: string, onChange: (v: string) => void): HTMLSelectElement {
    const select = h('select', { attrs: { 'aria-label': label } });
    select.append(h('option', { text: `any ${label.toLowerCase().replace('filter by ', '')}`, attrs: { value: '' } }));
    for (const value of values) {
      const option = h('option', { text: value, attrs: { value } });
      option.selected = value === current;
      select.append(option);
    }
    select.addEventListener('change', () => onChange(select.value));
    return select;
  }

  private _runs(runs: IRun[], total: number): HTMLElement {
    const section = h('section', { className: 'rapydli-Section', attrs: { 'aria-label': 'Runs' } });
    section.append(
      h('h2', { text: 'Runs' }),
      h('div', { className: 'rapydli-Toolbar' }, [
        this._select('Filter by kind', KINDS, this.model.filter.kind, kind => this.model.setFilter({ kind })),
        this._select('Filter by status', STATUSES, this.model.filter.status, status => this.model.setFilter({ status }))
      ])
    );
    if (runs.length === 0) {
      section.append(h('p', { className: 'rapydli-Empty', text: 'No recorded runs match.' }));
      return section;
    }
    const table = h('table', { className: 'rapydli-Table rapydli-RunTable', attrs: { 'aria-label': 'Run list' } });
    table.append(
      h('thead', {}, [
        h('tr', {}, ['Run', 'Status', 'Time', 'Key metric'].map(t => h('th', { text: t })))
      ])
    );
    const body = h('tbody');
    for (const run of runs) {
      const key = keyMetric(run.final ?? {});
      const row = h('tr', {
        className: `rapydli-Run rapydli-status-${run.status}`,
        attrs: { 'data-run-id': run.id, title: `Open run ${run.id}`, tabindex: '0' }
      }, [
        h('td', {}, [h('span', { className: 'rapydli-RunName', text: run.name }), h('span', { className: 'rapydli-Kind', text: run.kind })]),
        h('td', { className: 'rapydli-Status', text: run.status }),
        h('td', { text: formatDuration(run.duration, run.status === 'running' ? run.started : undefined) }),
        h('td', { text: key ? formatNumber(key[1]) : '', attrs: key ? { title: key[0] } : {} }, key ? [h('span', { className: 'rapydli-Kind', text: key[0] })] : [])
      ]);
      const open = () => void this.commands.execute(CommandIDs.openRun, { id: run.id });
      row.addEventListener('click', open);
      row.addEventListener('keydown', event => {
        if (event.key === 'Enter') {
          open();
        }
      });
      body.append(row);
    }
    table.append(body);
    section.append(table, h('p', { className: 'rapydli-Count', text: `${runs.length} of ${total} runs` }));
    return section;
  }

  private _sweeps(sweeps: IRun[]): HTMLElement {
    const section = h('section', { className: 'rapydli-Section', attrs: { 'aria-label': 'Sweeps' } });
    section.append(h('h2', { text: 'Sweeps' }));
    if (sweeps.length === 0) {
      section.append(h('p', { className: 'rapydli-Empty', text: 'No sweeps recorded.' }));
      return section;
    }
    const list = h('ul', { className: 'rapydli-List', attrs: { 'aria-label': 'Sweep list' } });
    for (const sweep of sweeps) {
      const key = keyMetric(sweep.final ?? {});
      const trials = sweep.params['trials'];
      const item = h('li', {
        className: `rapydli-Sweep rapydli-status-${sweep.status}`,
        attrs: { 'data-run-id': sweep.id, title: `Open sweep ${sweep.id}`, tabindex: '0' }
      }, [
        h('strong', { text: sweep.name }),
        h('span', {
          text: ` · ${sweep.status}${trials !== undefined ? ` · ${trials} trials` : ''}${key ? ` · best ${key[0]} ${formatNumber(key[1])}` : ''}`
        })
      ]);
      item.addEventListener('click', () => void this.commands.execute(CommandIDs.openRun, { id: sweep.id }));
      list.append(item);
    }
    section.append(list);
    return section;
  }
}
