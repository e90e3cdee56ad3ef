/**
 * The batch part of the run view: one row per item (parameters, status, recorded scalars,
 * failing cell), each executed notebook opened in Lab, and the batch's report.
 */
import { PageConfig, URLExt } from '@jupyterlab/coreutils';
import { CommandRegistry } from '@lumino/commands';

import { IArtifact, IBatchReply, requestAPI } from './api';
import { CommandIDs } from './commands';
import { formatNumber, formatShortDuration, h, statusBadge } from './format';
import { formatValue } from './params';

/** A file's path relative to the server root, or null when it lies outside. */
export function underRoot(path: string): string | null {
  const root = PageConfig.getOption('serverRoot').replace(/\/$/, '');
  return root && path.startsWith(root + '/') ? path.slice(root.length + 1) : null;
}

/** The download URL of artifact `index` of a run. */
export function artifactUrl(runId: string, index: number): string {
  return URLExt.join(PageConfig.getBaseUrl(), 'rapydli', 'api', 'runs', encodeURIComponent(runId), 'artifacts', String(index));
}

/** A link that opens a file in Lab when it is under the server root; else one that downloads it. */
export function fileLink(commands: CommandRegistry, path: string, download: string, label?: string): HTMLElement {
  const inside = underRoot(path);
  const name = label ?? path.split('/').pop() ?? path;
  if (inside !== null) {
    const link = h('a', { text: name, attrs: { href: '#', title: `Open ${inside} in JupyterLab` } });
    link.addEventListener('click', event => {
      event.preventDefault();
      event.stopPropagation();
      void commands.execute('docmanager:open', { path: inside });
    });
    return link;
  }
  if (!download) {
    return h('code', { text: path, attrs: { title: 'outside the JupyterLab root' } });
  }
  return h('a', { text: name, attrs: { href: download, download: '', title: `Download ${path}` } });
}

export function artifactList(commands: CommandRegistry, runId: string, artifacts: IArtifact[], label = 'Artifacts'): HTMLElement {
  const section = h('section', { className: 'rapydli-Artifacts', attrs: { 'aria-label': label } }, [h('h2', { text: label })]);
  if (artifacts.length === 0) {
    section.append(h('p', { className: 'rapydli-Empty', text: 'No artifacts.' }));
    return section;
  }
  const list = h('ul');
  artifacts.forEach((artifact, i) => {
    const url = artifactUrl(runId, i);
    list.append(
      h('li', {}, [
        h('span', { text: `${artifact.kind}: ` }),
        fileLink(commands, artifact.path, url),
        h('span', { text: ' · ' }),
        h('a', { text: 'download', attrs: { href: url, download: '', 'aria-label': `Download ${artifact.path.split('/').pop()}` } }),
        h('div', { className: 'rapydli-Meta', text: artifact.path })
      ])
    );
  });
  section.append(list);
  return section;
}

export async function batchSection(batchId: string, commands: CommandRegistry): Promise<HTMLElement> {
  const reply = await requestAPI<IBatchReply>(`batches/${encodeURIComponent(batchId)}`);
  const items = reply.items;
  const failed = items.filter(i => i.status === 'failed').length;
  const section = h('section', { className: 'rapydli-Items', attrs: { 'aria-label': 'Batch items' } }, [
    h('h2', { text: `Items (${items.length}, ${failed} failed)` })
  ]);
  const params: string[] = [];
  const scalars: string[] = [];
  for (const item of items) {
    for (const key of Object.keys(item.parameters)) {
      if (!params.includes(key)) {
        params.push(key);
      }
    }
    for (const key of Object.keys(item.final ?? {})) {
      if (!scalars.includes(key)) {
        scalars.push(key);
      }
    }
  }
  const table = h('table', { className: 'rapydli-Table', attrs: { 'aria-label': 'Items table' } }, [
    h('thead', {}, [
      h('tr', {}, ['item', 'notebook', ...params, 'status', 'failing cell', ...scalars, 'duration'].map(t => h('th', { text: t })))
    ])
  ]);
  const body = h('tbody');
  for (const item of items) {
    const notebook = item.notebook;
    const row = h('tr', {
      className: 'rapydli-ClickRow',
      attrs: { 'data-run-id': item.id, 'data-status': item.status, title: `Open item ${item.name}` }
    }, [
      h('td', { text: item.name }),
      h('td', {}, notebook ? [fileLink(commands, notebook, '', 'open')] : []),
      ...params.map(k => h('td', { text: formatValue(item.parameters[k]) })),
      h('td', { className: 'rapydli-Nowrap' }, [statusBadge(item.status), ` ${item.status}`]),
      h('td', { className: 'rapydli-FailingCell', text: item.failing_cell ?? '' }),
      ...scalars.map(k => h('td', { className: 'rapydli-Clip', text: formatNumber(item.final?.[k]), attrs: { title: String(item.final?.[k] ?? '') } })),
      h('td', { text: formatShortDuration(item.duration) })
    ]);
    row.addEventListener('click', () => void commands.execute(CommandIDs.openRun, { id: item.id }));
    body.append(row);
  }
  table.append(body);
  section.append(h('div', { className: 'rapydli-Wide' }, [table]), artifactList(commands, batchId, reply.artifacts, 'Report'));
  return section;
}
