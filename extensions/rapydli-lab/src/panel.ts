import { CommandRegistry } from '@lumino/commands';
import { Widget } from '@lumino/widgets';

import { ICluster, IFamilyRun } from './api';
import { CommandIDs } from './commands';
import {
  formatAgo,
  formatCompact,
  formatShortDuration,
  h,
  keyMetric,
  shortId,
  statusBadge
} from './format';
import { PAGE_SIZE, RapydliModel } from './model';

const KINDS = ['train', 'sweep', 'trial', 'scaling', 'batch', 'tune'];
const STATUSES = ['running', 'finished', 'failed', 'interrupted', 'pruned'];
/** Sort choices: label -> [sort key, order]. */
const SORTS: Record<string, [string, 'asc' | 'desc']> = {
  newest: ['started', 'desc'],
  oldest: ['started', 'asc'],
  'name A-Z': ['name', 'asc'],
  'name Z-A': ['name', 'desc'],
  longest: ['duration', 'desc'],
  shortest: ['duration', 'asc'],
  status: ['status', 'asc'],
  kind: ['kind', 'asc']
};
const CHILDREN_NOUN: Record<string, string> = { sweep: 'trials', batch: 'items', scaling: 'points' };
const ORIGIN: Record<string, string> = { server: 'this server', detached: 'CLI', kernel: 'kernel' };

/** A family's key metric: a sweep's best trial value, else the run's own. */
export function familyMetric(run: IFamilyRun, children: IFamilyRun[] = []): [string, number] | null {
  const params = run.params ?? {};
  const metric = params['metric'];
  if (run.kind === 'sweep' && typeof metric === 'string') {
    const values = children
      .map(c => c.final?.[metric])
      .filter((v): v is number => typeof v === 'number');
    if (values.length > 0) {
      const best = params['direction'] === 'maximize' ? Math.max(...values) : Math.min(...values);
      return ['best', best];
    }
  }
  return keyMetric(run.final ?? {});
}

/**
 * The left side panel: every running cluster, and the runs as families (a sweep with its
 * trials, a batch with its items) with filters, order, pages and a compare selection.
 * The toolbar is built once (typing in the search box survives the polls); the lists are
 * re-rendered whenever the model polls.
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
    this._alerts = h('div');
    this._clusters = h('section', { className: 'rapydli-Section', attrs: { 'aria-label': 'Clusters' } });
    this._runs = h('div');
    this._compare = h('button', {
      className: 'jp-mod-styled rapydli-Button rapydli-CompareButton',
      attrs: { type: 'button' }
    });
    this._compare.addEventListener('click', () => {
      void this.commands.execute(CommandIDs.openCompare, { ids: this.model.selected.join(',') });
    });
    this.node.append(
      h('div', { className: 'rapydli-Panel-content' }, [
        h('h1', { className: 'rapydli-Panel-title', text: 'RaPyDLI' }),
        this._alerts,
        this._clusters,
        h('section', { className: 'rapydli-Section', attrs: { 'aria-label': 'Runs' } }, [
          h('h2', { text: 'Runs' }),
          this._runToolbar(),
          this._runs
        ])
      ])
    );
    model.changed.connect(this._render, this);
    this._render();
  }

  dispose(): void {
    this.model.changed.disconnect(this._render, this);
    super.dispose();
  }

  private _render(): void {
    const model = this.model;
    this._alerts.replaceChildren();
    if (model.pollError) {
      this._alerts.append(h('div', { className: 'rapydli-Error', text: model.pollError, attrs: { role: 'alert' } }));
    }
    if (model.actionError) {
      const dismiss = h('button', {
        className: 'rapydli-Dismiss',
        text: '×',
        attrs: { type: 'button', 'aria-label': 'Dismiss error', title: 'Dismiss' }
      });
      dismiss.addEventListener('click', () => model.setError(null));
      this._alerts.append(h('div', { className: 'rapydli-Error', attrs: { role: 'alert' } }, [dismiss, model.actionError]));
    }
    this._renderClusters(model.clusters);
    this._renderRuns();
  }

  private _button(label: string, command: string, args: Record<string, string> = {}, title = label): HTMLButtonElement {
    const button = h('button', {
      className: 'jp-mod-styled rapydli-Button',
      text: label,
      attrs: { type: 'button', title, 'aria-label': title }
    });
    button.addEventListener('click', event => {
      event.stopPropagation();
      void this.commands.execute(command, args);
    });
    return button;
  }

  private _renderClusters(clusters: ICluster[]): void {
    const section = this._clusters;
    section.replaceChildren(
      h('h2', { text: 'Clusters' }),
      h('div', { className: 'rapydli-Toolbar' }, [
        this._button('Start…', CommandIDs.startCluster, {}, 'Start cluster'),
        this._button('Insert %%distributed cell', CommandIDs.insertDistributedCell, {}, 'Insert %%distributed cell')
      ])
    );
    if (clusters.length === 0) {
      section.append(h('p', { className: 'rapydli-Empty', text: 'No running cluster.' }));
      return;
    }
    const list = h('ul', { className: 'rapydli-List', attrs: { 'aria-label': 'Cluster list' } });
    const now = Date.now() / 1000;
    for (const cluster of clusters) {
      const busy = ['stopping', 'restarting', 'starting'].includes(cluster.state);
      const item = h('li', {
        className: `rapydli-Cluster rapydli-state-${cluster.state}`,
        attrs: { 'data-cluster-id': cluster.id, 'data-state': cluster.state, 'aria-label': `Cluster ${cluster.id}` }
      });
      item.append(
        h('div', { className: 'rapydli-Line' }, [
          h('strong', { className: 'rapydli-Ellipsis', text: cluster.id, attrs: { title: cluster.id } }),
          h('span', { className: 'rapydli-Origin', text: ORIGIN[cluster.origin] ?? cluster.origin }),
          h('span', { className: `rapydli-State rapydli-state-${cluster.state}`, text: busy ? `${cluster.state}…` : cluster.state })
        ]),
        h('div', { className: 'rapydli-Meta' }, [
          h('span', { className: 'rapydli-Engines', text: `${cluster.engines_alive}/${cluster.n} engines` }),
          h('span', { text: ` · ${cluster.launcher}` }),
          h('span', { text: cluster.hosts.length ? ` · ${cluster.hosts.join(', ')}` : '' }),
          h('span', {
            text: ` · ${['running', 'degraded'].includes(cluster.state) ? 'up' : 'for'} ${formatShortDuration(now - cluster.created)}`
          })
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
      const restart = this._button('Restart', CommandIDs.restartCluster, { id: cluster.id }, `Restart cluster ${cluster.id}`);
      const stop = this._button('Stop', CommandIDs.stopCluster, { id: cluster.id }, `Stop cluster ${cluster.id}`);
      restart.disabled = busy || cluster.origin === 'kernel';
      if (cluster.origin === 'kernel') {
        restart.title = 'Held by a kernel: restart it there';
      }
      stop.disabled = cluster.state === 'stopping';
      const where = this._button('Where', CommandIDs.whereCluster, { id: cluster.id }, `Where cluster ${cluster.id} stands`);
      where.disabled = !['running', 'degraded'].includes(cluster.state) || cluster.origin === 'kernel';
      if (cluster.origin === 'kernel') {
        where.title = 'Held by a kernel: run %rapydli where there';
      }
      item.append(h('div', { className: 'rapydli-Toolbar' }, [restart, stop, where]));
      list.append(item);
    }
    section.append(list);
  }

  private _select(label: string, values: string[], current: string, onChange: (v: string) => void, any = true): HTMLSelectElement {
    const select = h('select', { className: 'rapydli-Select', attrs: { 'aria-label': label, title: label } });
    if (any) {
      select.append(h('option', { text: `any ${label.toLowerCase().replace('filter by ', '')}`, attrs: { value: '' } }));
    }
    for (const value of values) {
      const option = h('option', { text: value, attrs: { value } });
      option.selected = value === current;
      select.append(option);
    }
    select.addEventListener('change', () => onChange(select.value));
    return select;
  }

  private _runToolbar(): HTMLElement {
    const model = this.model;
    const search = h('input', {
      className: 'rapydli-Search',
      attrs: { type: 'search', placeholder: 'Search name, id, tag, note', 'aria-label': 'Search runs' }
    });
    let timer = 0;
    search.addEventListener('input', () => {
      window.clearTimeout(timer);
      timer = window.setTimeout(() => model.setFilter({ text: search.value }), 250);
    });
    const sort = this._select('Sort runs', Object.keys(SORTS), 'newest', label => {
      const [key, order] = SORTS[label];
      model.setFilter({ sort: key, order });
    }, false);
    return h('div', { className: 'rapydli-RunToolbar' }, [
      search,
      h('div', { className: 'rapydli-Toolbar' }, [
        this._select('Filter by kind', KINDS, model.filter.kind, kind => model.setFilter({ kind })),
        this._select('Filter by status', STATUSES, model.filter.status, status => model.setFilter({ status })),
        sort
      ]),
      h('div', { className: 'rapydli-Toolbar' }, [this._compare])
    ]);
  }

  private _renderRuns(): void {
    const model = this.model;
    const n = model.selected.length;
    this._compare.textContent = n ? `Compare ${n} selected` : 'Compare: tick 2+ runs';
    this._compare.disabled = n < 2;
    this._compare.setAttribute('aria-label', 'Compare selected runs');
    if (model.families.length === 0) {
      this._runs.replaceChildren(h('p', { className: 'rapydli-Empty', text: 'No recorded runs match.' }));
      return;
    }
    const table = h('table', { className: 'rapydli-Table rapydli-RunTable', attrs: { 'aria-label': 'Run list' } });
    table.append(
      h('colgroup', {}, [
        h('col', { className: 'rapydli-col-select' }),
        h('col', { className: 'rapydli-col-run' }),
        h('col', { className: 'rapydli-col-metric' })
      ]),
      h('thead', {}, [
        h('tr', {}, [
          h('th', { text: '', attrs: { 'aria-label': 'Select' } }),
          h('th', { className: 'rapydli-Ellipsis', text: 'Run', attrs: { title: 'status and name; id · started · duration · tags' } }),
          h('th', { className: 'rapydli-Metric', text: 'Metric', attrs: { title: 'Key metric (a sweep: its best trial)' } })
        ])
      ])
    );
    const body = h('tbody');
    for (const family of model.families) {
      body.append(this._row(family, family.children, false));
      if (model.expanded.has(family.id)) {
        for (const child of family.children) {
          body.append(this._row(child, [], true));
        }
      }
    }
    table.append(body);
    const total = model.totalFamilies;
    const first = model.offset + 1;
    const last = model.offset + model.families.length;
    const prev = h('button', { className: 'jp-mod-styled rapydli-Button', text: '‹', attrs: { type: 'button', 'aria-label': 'Previous page', title: 'Previous page' } });
    const next = h('button', { className: 'jp-mod-styled rapydli-Button', text: '›', attrs: { type: 'button', 'aria-label': 'Next page', title: 'Next page' } });
    prev.disabled = model.offset === 0;
    next.disabled = last >= total;
    prev.addEventListener('click', () => model.setPage(model.offset - PAGE_SIZE));
    next.addEventListener('click', () => model.setPage(model.offset + PAGE_SIZE));
    this._runs.replaceChildren(
      table,
      h('div', { className: 'rapydli-Pager' }, [
        prev,
        h('span', { className: 'rapydli-Count rapydli-Nowrap', text: `${first}–${last} of ${total} runs` }),
        next
      ])
    );
  }

  private _row(run: IFamilyRun, children: IFamilyRun[], child: boolean): HTMLTableRowElement {
    const model = this.model;
    const status = run.state && run.state !== run.status && run.state !== 'COMPLETE' ? run.state : run.status;
    const row = h('tr', {
      className: `rapydli-Run rapydli-status-${status}${child ? ' rapydli-Child' : ' rapydli-Family'}`,
      attrs: {
        'data-run-id': run.id,
        'data-kind': run.kind,
        'data-status': status,
        title: `Open ${run.kind} ${run.name} (${run.id}, ${status})${run.prune ? `\n${run.prune.text}` : ''}`,
        tabindex: '0'
      }
    });
    const check = h('input', { attrs: { type: 'checkbox', 'aria-label': `Select ${run.name} ${shortId(run.id)} for comparing` } });
    check.checked = model.selected.includes(run.id);
    check.addEventListener('click', event => {
      event.stopPropagation();
      model.toggleSelected(run.id);
    });
    const nameLine = h('div', { className: 'rapydli-Line' });
    if (!child && run.n_children > 0) {
      const open = model.expanded.has(run.id);
      const toggle = h('button', {
        className: 'rapydli-Expander',
        text: open ? '▾' : '▸',
        attrs: { type: 'button', 'aria-expanded': String(open), 'aria-label': `${open ? 'Collapse' : 'Expand'} ${run.name}` }
      });
      toggle.addEventListener('click', event => {
        event.stopPropagation();
        model.toggleExpanded(run.id);
      });
      nameLine.append(toggle);
    }
    nameLine.append(statusBadge(status));
    const [head, tail] = splitName(run.name);
    nameLine.append(
      h('span', { className: 'rapydli-RunName', attrs: { title: run.name } }, [
        h('span', { className: 'rapydli-NameHead rapydli-Ellipsis', text: head }),
        h('span', { className: 'rapydli-NameTail', text: tail })
      ])
    );
    if (!child && run.n_children > 0) {
      nameLine.append(h('span', { className: 'rapydli-Count rapydli-Nowrap', text: `${run.n_children} ${CHILDREN_NOUN[run.kind] ?? 'runs'}` }));
    }
    const meta = h('div', { className: 'rapydli-Meta' }, [
      h('code', { className: 'rapydli-Id', text: shortId(run.id), attrs: { title: run.id } }),
      h('span', { text: '\u2009·\u2009' }),
      h('span', { className: 'rapydli-Started', text: formatAgo(run.started), attrs: { title: new Date(run.started * 1000).toLocaleString() } }),
      h('span', { text: '\u2009·\u2009' }),
      h('span', { className: 'rapydli-Duration', text: formatShortDuration(run.duration ?? (run.status === 'running' ? Date.now() / 1000 - run.started : null)) })
    ]);
    for (const tag of run.tags ?? []) {
      meta.append(h('span', { className: 'rapydli-Tag', text: tag }));
    }
    const key = familyMetric(run, children);
    row.append(
      h('td', { className: 'rapydli-SelectCell' }, [check]),
      h('td', { className: 'rapydli-RunCell' }, [nameLine, meta]),
      h('td', { className: 'rapydli-Metric', attrs: key ? { title: key[0] === 'best' ? `best ${String(run.params['metric'])} of its trials = ${key[1]}` : `${key[0]} = ${key[1]}` } : {} }, key ? [
        h('div', { className: 'rapydli-Nowrap', text: formatCompact(key[1]) }),
        h('div', { className: 'rapydli-Meta rapydli-Ellipsis', text: key[0] })
      ] : [])
    );
    const open = () => void this.commands.execute(CommandIDs.openRun, { id: run.id });
    row.addEventListener('click', open);
    row.addEventListener('keydown', event => {
      if (event.key === 'Enter') {
        open();
      }
    });
    return row;
  }

  private _alerts: HTMLElement;
  private _clusters: HTMLElement;
  private _runs: HTMLElement;
  private _compare: HTMLButtonElement;
}

/** How many characters of a long run name's end always show (the rest is cut with an ellipsis). */
const NAME_TAIL = 12;

/**
 * A run name as [head, tail]: the head is cut with an ellipsis when the panel is narrow, the
 * tail always shows. Names that differ only at the end ("plan dp2 pp1 tp1 zero1", "... zero2")
 * stay apart at the default sidebar width. The tail starts at a word where one is near.
 */
export function splitName(name: string): [string, string] {
  if (name.length <= NAME_TAIL + 4) {
    return ['', name];
  }
  let at = name.length - NAME_TAIL;
  const space = name.lastIndexOf(' ', at + 4);
  if (space > at - 6 && space > 0) {
    at = space + 1;
  }
  return [name.slice(0, at), name.slice(at)];
}
