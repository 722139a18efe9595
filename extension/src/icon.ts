import { LabIcon } from '@jupyterlab/ui-components';

/** Four connected nodes: ranks talking to each other. */
const svg = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <circle cx="5" cy="5" r="3"/><circle cx="19" cy="5" r="3"/>
    <circle cx="5" cy="19" r="3"/><circle cx="19" cy="19" r="3"/>
    <path d="M7 4.2h10v1.6H7zM7 18.2h10v1.6H7zM4.2 7h1.6v10H4.2zM18.2 7h1.6v10h-1.6zM6.4 7.5l1.1-1.1 10.1 10.1-1.1 1.1z"/>
  </g>
</svg>`;

export const distributedIcon = new LabIcon({
  name: 'notebook-launcher:distributed',
  svgstr: svg
});
